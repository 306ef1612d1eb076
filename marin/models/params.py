"""The model's parameter table: every leaf's key, role and shapes, in one place.

Every consumer of the parameter tree reads a leaf's **role** from here (the vocabulary is
:mod:`marin.parallel.roles`), never a list of names of its own: the mesh's sharding rule (an
``expert_stack`` is split over the experts), the optimizer's groups (MuonH orthogonalises the dense
matrices and expert stacks), AdamW's weight decay (none on a ``vector``), the exported tensors'
names and shapes, and the memory planner (per-device shards, leaf by leaf). The shapes the planner
and the exporter count are the table's (:func:`marin.models.config.param_shapes`), which
tests hold equal to :func:`marin.models.transformer.init_params`' arrays; a leaf ``init_params``
builds without an entry here is refused when the model is built (:func:`check_param_tree`).

Keys are the params' paths: ``"embed"``, ``"final_norm"``, ``"lm_head"`` and ``"blocks/<leaf>"``
(stacked: a leading [n_layers] axis). The router's balancing bias is training state, not a parameter
(``state=True``): it has a role and is exported, but it is in no parameter tree.

Adding a parameter: an entry here (role, stored shape and, where the export drops padding, the
exported shape), its initialisation in ``init_params`` and its use in the forward
(docs/extending.md, "A model parameter").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from marin.parallel.roles import (
    DENSE_MATRIX,
    EMBEDDING,
    EXPERT_STACK,
    HEAD,
    ROLES,
    ROUTER,
    ROUTER_BIAS,
    VECTOR,
    check_role,
    register_leaf_role,
)

MoEConfig = Any
"""A :class:`marin.models.config.MoEConfig` (not imported: the config reads this table)."""


@dataclasses.dataclass(frozen=True)
class Param:
    """One leaf of the table. ``shape(cfg)``: the stored shape (a block leaf's with its [n_layers] axis;
    padded where the mesh needs it). ``exported(cfg, layer)``: the exported tensor's shape (a block
    leaf's one layer), the stored one cut to its real size at the end of each axis; None: the stored
    shape (less the layer axis). ``present(cfg)``: whether the config has the leaf (the head is absent
    with tied embeddings). ``state``: held in the training state, not the params (the router bias)."""

    role: str
    shape: Callable[[MoEConfig], tuple[int, ...]]
    exported: Callable[[MoEConfig, int], tuple[int, ...]] | None = None
    present: Callable[[MoEConfig], bool] = lambda cfg: True
    state: bool = False

    def __post_init__(self) -> None:
        check_role(self.role, "Param")


def _q(c: MoEConfig) -> int:
    return c.n_heads * c.head_dim


def _shared(c: MoEConfig) -> int:
    return c.n_shared_experts * c.shared_width


def _kv_exported(c: MoEConfig, i: int) -> tuple[int, ...]:
    return (c.d_model, c.kv_heads_of(i) * c.head_dim)  # each layer at its own KV-head count


PARAMS: dict[str, Param] = {
    "embed": Param(EMBEDDING, lambda c: (c.vocab_size, c.d_model)),
    "final_norm": Param(VECTOR, lambda c: (c.d_model,)),
    "lm_head": Param(HEAD, lambda c: (c.d_model, c.vocab_size), present=lambda c: not c.tie_embeddings),
    "blocks/attn_norm": Param(VECTOR, lambda c: (c.n_layers, c.d_model)),
    "blocks/wq": Param(DENSE_MATRIX, lambda c: (c.n_layers, c.d_model, _q(c))),
    "blocks/wk": Param(DENSE_MATRIX, lambda c: (c.n_layers, c.d_model, c.stored_kv_heads * c.head_dim), _kv_exported),
    "blocks/wv": Param(DENSE_MATRIX, lambda c: (c.n_layers, c.d_model, c.stored_kv_heads * c.head_dim), _kv_exported),
    "blocks/wo": Param(DENSE_MATRIX, lambda c: (c.n_layers, _q(c), c.d_model)),
    "blocks/mlp_norm": Param(VECTOR, lambda c: (c.n_layers, c.d_model)),
    "blocks/shared_gate": Param(DENSE_MATRIX, lambda c: (c.n_layers, c.d_model, _shared(c))),
    "blocks/shared_up": Param(DENSE_MATRIX, lambda c: (c.n_layers, c.d_model, _shared(c))),
    "blocks/shared_down": Param(DENSE_MATRIX, lambda c: (c.n_layers, _shared(c), c.d_model)),
    "blocks/latent_down": Param(DENSE_MATRIX, lambda c: (c.n_layers, c.d_model, c.latent_dim)),
    "blocks/latent_up": Param(DENSE_MATRIX, lambda c: (c.n_layers, c.latent_dim, c.d_model)),
    "blocks/router": Param(ROUTER, lambda c: (c.n_layers, c.latent_dim, c.n_experts)),
    "blocks/router_bias": Param(ROUTER_BIAS, lambda c: (c.n_moe_layers, c.n_experts), state=True),
    # routed experts at the stored width (padded to a multiple the mesh divides), exported at the real one
    "blocks/expert_gate": Param(EXPERT_STACK, lambda c: (c.n_layers, c.n_experts, c.latent_dim, c.stored_expert_width),
                                lambda c, i: (c.n_experts, c.latent_dim, c.expert_width)),
    "blocks/expert_up": Param(EXPERT_STACK, lambda c: (c.n_layers, c.n_experts, c.latent_dim, c.stored_expert_width),
                              lambda c, i: (c.n_experts, c.latent_dim, c.expert_width)),
    "blocks/expert_down": Param(EXPERT_STACK, lambda c: (c.n_layers, c.n_experts, c.stored_expert_width, c.latent_dim),
                                lambda c, i: (c.n_experts, c.expert_width, c.latent_dim)),
}
"""Every leaf of the model: key -> :class:`Param`. Register a new one with :func:`register_param`."""


def leaf_name(key: str) -> str:
    """``"blocks/wq"`` -> ``"wq"``: the leaf's own name, the last key of its path."""
    return key.rsplit("/", 1)[-1]


def register_param(key: str, param: Param) -> None:
    """Add (or replace) the table's entry ``key`` and register its leaf's role with the parallel layer
    (which walks trees by leaf name: one name, one role)."""
    register_leaf_role(leaf_name(key), param.role)
    PARAMS[key] = param


for _key, _param in PARAMS.items():
    register_leaf_role(leaf_name(_key), _param.role)


def role_of(key: str) -> str:
    """The role of the leaf at ``key`` (``"blocks/wq"``, or a leaf's own name ``"wq"``); one line
    naming the table when it has none."""
    param = PARAMS.get(key) or PARAMS.get(f"blocks/{key}")
    if param is None:
        raise ValueError(f"parameter leaf {key!r} has no role: give it one in marin.models.params.PARAMS "
                         f"(roles: {', '.join(ROLES)})")
    return param.role


def params_of(cfg: MoEConfig) -> dict[str, Param]:
    """The table's parameter leaves ``cfg`` has (no training state), in table order."""
    return {k: p for k, p in PARAMS.items() if not p.state and p.present(cfg)}


def leaves_by_role(cfg: MoEConfig, *roles: str) -> tuple[str, ...]:
    """The keys of ``cfg``'s leaves of any of ``roles`` (the training state's too), in table order."""
    return tuple(k for k, p in PARAMS.items() if p.role in roles and p.present(cfg))


def check_param_tree(params: Mapping[str, Any]) -> None:
    """Refuse, in one line, a parameter tree (``{"embed": ..., "blocks": {...}}``) with a leaf the table
    has no entry (no role) for: the mesh would place it, the optimizer group it and the exporter
    write it by guesswork."""
    for name, value in params.items():
        keys = [f"{name}/{k}" for k in value] if isinstance(value, Mapping) else [name]
        for key in keys:
            if key not in PARAMS or PARAMS[key].state:
                raise ValueError(f"parameter leaf {key!r} has no role: give it one in marin.models.params.PARAMS "
                                 f"(roles: {', '.join(ROLES)})")
