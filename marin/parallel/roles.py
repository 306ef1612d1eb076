"""What a parameter leaf is, by role: the vocabulary every consumer of the parameter tree reads.

A model's parameter leaves are named by the model (``"blocks/wq"``, ``"embed"``); what the rest of
the code needs to know of a leaf is its **role**, and that is all it reads:

==================  ==========================================================================
role                what it is, and what reads it
==================  ==========================================================================
``dense_matrix``    a weight matrix every token multiplies (attention, the shared experts, the
                    latent projections): split by FSDP; MuonH's orthogonalised group
``expert_stack``    a routed-expert stack, axis 1 (after the layer axis) the experts: split over
                    the "expert" axis (expert parallelism); MuonH's group
``vector``          a gain or scale (a norm's weights; 1-D per layer): never split; no weight
                    decay; Adam's group
``embedding``       the token embedding [vocab, d]: split by FSDP like a matrix; Adam's group
``head``            the output head [d, vocab]: split by FSDP; AdamH's group
``router``          the router's matrix [latent, experts]: split by FSDP; Adam's group
``router_bias``     the router's balancing bias: training state, not a weight (no gradient)
==================  ==========================================================================

The model package owns the table that gives each of its leaves a role
(:data:`marin.models.params.PARAMS`) and registers each leaf's name and role here
(:func:`register_leaf_role`) when it is imported. This module sits below the models because the
parallel layer (the mesh's sharding of any tree that mirrors the parameters: the params, the
optimizer's moments) must know a leaf's role, and it imports nothing from the models; the vocabulary
and this registry are all it shares with them.
"""

from __future__ import annotations

from collections.abc import Sequence

DENSE_MATRIX = "dense_matrix"
EXPERT_STACK = "expert_stack"
VECTOR = "vector"
EMBEDDING = "embedding"
HEAD = "head"
ROUTER = "router"
ROUTER_BIAS = "router_bias"
ROLES = (DENSE_MATRIX, EXPERT_STACK, VECTOR, EMBEDDING, HEAD, ROUTER, ROUTER_BIAS)

LEAF_ROLES: dict[str, str] = {}
"""Each parameter leaf's own name (``"wq"``: the last key of its path) -> its role, registered by
the model package (:data:`marin.models.params.PARAMS`)."""


def check_role(role: str, what: str) -> str:
    """``role`` if it is one of :data:`ROLES`, else a one-line ValueError naming ``what``."""
    if role not in ROLES:
        raise ValueError(f"{what}: unknown parameter role {role!r}; choose from {', '.join(ROLES)}")
    return role


def register_leaf_role(name: str, role: str) -> None:
    """Register leaf ``name`` (its own name, the last key of its path) with ``role``; a name already
    registered with another role is refused (a tree walked by leaf name could not tell them apart)."""
    check_role(role, f"parameter leaf {name!r}")
    if LEAF_ROLES.get(name, role) != role:
        raise ValueError(f"parameter leaf {name!r} is registered as {LEAF_ROLES[name]}, not {role}: "
                         "two leaves of one name need one role")
    LEAF_ROLES[name] = role


def leaf_role(name: str, shape: Sequence[int]) -> str:
    """The role of a leaf of a tree that mirrors the parameters (the params, the optimizer's moments),
    by its own name. A scalar or a vector that is no parameter (an optimizer's step count) is a
    ``vector``; a larger leaf without a role is refused in one line: it would be placed by guesswork."""
    role = LEAF_ROLES.get(name)
    if role is not None:
        return role
    if len(shape) <= 1:
        return VECTOR
    raise ValueError(f"parameter leaf {name!r} {list(shape)} has no role: give it one in the model's parameter "
                     f"table (marin.models.params.PARAMS; roles: {', '.join(ROLES)})")
