"""MuonH, as upstream Marin's hero run trains: Muon's orthogonalised momentum on the hidden matrices,
moved on the "hyperball" (every matrix keeps its Frobenius norm), AdamH on the LM head, plain Adam on
the rest. JAX-free (the update itself is :func:`marin.training.optimizers.updates.muonh`).

Groups, by the parameter leaf's role (the model's parameter table, :mod:`marin.models.params`):

``muonh``  the dense matrices (attention's ``wq``, ``wk``, ``wv``, ``wo``, the shared experts, the
           latent projections) and the routed-expert stacks (``expert_gate``, ``expert_up``,
           ``expert_down``: [layers, experts, in, out]): momentum ``momentum`` with Nesterov, then 5 quintic
           Newton-Schulz iterations per matrix, then the hyperball step at the schedule's LR
           (``peak_lr`` at the peak): ``W' = W - lr * O * |W| / |O|``, projected back to ``|W|``.
           Every matrix of a stack (each layer, each expert) is orthogonalised and keeps its own
           norm. One float32 momentum buffer per element.
``adamh``  the head (the LM head): Adam's update direction, moved on the hyperball like MuonH's, at the same LR.
``adam``   the embedding, the router and the vectors (1-D gains): Adam (no weight decay) at ``adam_lr`` x the
           schedule's shape (the same warmup, decay and re-plans at its own peak). Two float32
           moments per element. (The router's balancing bias is training state the balancing rule
           updates, not a parameter: no optimizer touches it.)

The hyperball replaces weight decay: a matrix's norm is fixed at its initial value, so an update
rotates it and the LR is an angle. ``grad_clip`` (None: off, as upstream's hero runs) clips the whole
gradient's global norm before the groups split.

Why not ``optax.contrib.muon``: it orthogonalises each leaf as one matrix (or reshapes a stack as its
caller says) and then scales the update by a shape factor; it has no hyperball step (norm-preserving
update and projection, per matrix of a stack), no AdamH group, and its Newton-Schulz iterations run
over all layers of a stack at once, where this one maps over the layer axis (one layer's temporaries
at a time) and vmaps the expert axis (each device orthogonalises its own experts).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Literal

from marin.models.params import role_of
from marin.parallel.roles import DENSE_MATRIX, EXPERT_STACK, HEAD
from marin.training.optimizers.base import (
    ADAM_GROUP,
    ADAMH_GROUP,
    MUONH_GROUP,
    OptimizerBase,
    register_optimizer,
)

MUONH = "muonh"
MUONH_ROLES = (DENSE_MATRIX, EXPERT_STACK)
"""The roles MuonH orthogonalises (every matrix a token multiplies, each expert's too)."""
ADAMH_ROLES = (HEAD,)
# Upstream Marin's learning-rate heuristic for the hero's MuonH recipe
HEURISTIC_ADAM_SCALE = 0.06602
HEURISTIC_TOKENS_EXPONENT = -0.395
HEURISTIC_WIDTH_EXPONENT = -0.15
MUONH_OVER_ADAM = 13.0 / 3.0
MUONH_LR_CAP = 0.05
BETA2_REFERENCE_BATCH = 131_072


def heuristic_hyperparameters(tokens: float, d_model: int, tokens_per_batch: int) -> dict[str, float]:
    """Upstream Marin's rule for MuonH's learning rates from the run's size: ``adam_lr = 0.06602 x
    tokens^-0.395 x d_model^-0.15 x sqrt(tokens_per_batch)``, MuonH's (``peak_lr``) 13/3 of it capped
    at 0.05, and ``beta2 = 0.999^(tokens_per_batch / 131072)`` clipped to [0.95, 0.9999] (the same
    averaging horizon in tokens at any batch size). ``tokens``: the run's training tokens."""
    if tokens <= 0 or d_model <= 0 or tokens_per_batch <= 0:
        raise ValueError(f"need tokens, d_model and tokens_per_batch > 0, got {tokens}, {d_model}, {tokens_per_batch}")
    adam_lr = (HEURISTIC_ADAM_SCALE * tokens ** HEURISTIC_TOKENS_EXPONENT * d_model ** HEURISTIC_WIDTH_EXPONENT
               * math.sqrt(tokens_per_batch))
    beta2 = min(max(0.999 ** (tokens_per_batch / BETA2_REFERENCE_BATCH), 0.95), 0.9999)
    return {"adam_lr": adam_lr, "peak_lr": min(MUONH_OVER_ADAM * adam_lr, MUONH_LR_CAP), "beta2": beta2}


@register_optimizer
@dataclasses.dataclass(frozen=True)
class MuonHConfig(OptimizerBase):
    """MuonH / AdamH / Adam by parameter group (module docstring). ``peak_lr``: MuonH's and AdamH's
    peak LR; ``adam_lr``: the Adam group's peak (same schedule shape)."""

    peak_lr: float = 0.02
    adam_lr: float = 6e-4
    momentum: float = 0.95
    nesterov: bool = True
    newton_schulz_steps: int = 5
    muon_eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float | None = None
    kind: Literal["muonh"] = MUONH

    STATE_BYTES: ClassVar[dict[str, int]] = {MUONH_GROUP: 4, ADAMH_GROUP: 8, ADAM_GROUP: 8}
    NEWTON_SCHULZ_GROUPS: ClassVar[tuple[str, ...]] = (MUONH_GROUP,)
    FIELD_RANGES: ClassVar[dict[str, str]] = {
        **OptimizerBase.FIELD_RANGES, "adam_lr": "> 0", "momentum": "[0, 1)", "newton_schulz_steps": ">= 1",
        "muon_eps": "> 0", "beta1": "[0, 1)", "beta2": "[0, 1)", "adam_eps": "> 0", "grad_clip": "> 0"}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kind != MUONH:
            raise ValueError(f"MuonHConfig.kind is {MUONH!r}, got {self.kind!r}")

    @classmethod
    def from_heuristic(cls, tokens: float, d_model: int, tokens_per_batch: int, **fields: Any) -> MuonHConfig:
        """The config :func:`heuristic_hyperparameters` gives a run of ``tokens`` training tokens at
        width ``d_model`` and ``tokens_per_batch`` tokens per step (``fields`` override it)."""
        return cls(**{**heuristic_hyperparameters(tokens, d_model, tokens_per_batch), **fields})

    @property
    def adam_lr_ratio(self) -> float:
        """The Adam group's LR over the schedule's (its own peak on the same schedule shape)."""
        return self.adam_lr / self.peak_lr

    def leaf_group(self, key: str, shape: tuple[int, ...]) -> str:
        role = role_of(key)
        if role in MUONH_ROLES:
            return MUONH_GROUP
        if role in ADAMH_ROLES:
            return ADAMH_GROUP
        return ADAM_GROUP

    def transformation(self) -> Any:
        # JAX and optax: only where a step is compiled (the config is read by the planner and the CLI)
        from marin.training.optimizers.updates import muonh

        return muonh(self)
