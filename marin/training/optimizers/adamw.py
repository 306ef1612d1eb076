"""AdamW with global-norm gradient clipping: every parameter in one group, two float32 moments each.

Weight decay applies to matrices only (a norm's 1-D gains are left alone). The fields and their
names are those TrainConfig's optimizer had before optimizers were components, so every step
declared with AdamW keeps its hash; ``kind`` (the union's tag) enters the version only if it were
ever set to another value, which its type forbids.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

from marin.execution.versioning import added_later
from marin.training.optimizers.base import OptimizerBase, register_optimizer

ADAMW = "adamw"


@register_optimizer
@dataclasses.dataclass(frozen=True)
class AdamWConfig(OptimizerBase):
    """AdamW (``beta1``, ``beta2``, ``adam_eps``; decoupled ``weight_decay`` on matrices) after clipping
    the gradient to global norm ``grad_clip``, at the schedule's LR."""

    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    kind: Literal["adamw"] = added_later(default=ADAMW)

    STATE_BYTES: ClassVar[dict[str, int]] = {ADAMW: 8}  # first and second moments, float32
    FIELD_RANGES: ClassVar[dict[str, str]] = {**OptimizerBase.FIELD_RANGES, "weight_decay": ">= 0", "beta1": "[0, 1)",
                                              "beta2": "[0, 1)", "adam_eps": "> 0", "grad_clip": "> 0"}
    PROGRAM_ONLY_SCHEDULE: ClassVar[tuple[str, ...]] = ("peak_lr", "warmup_steps", "final_lr_fraction", "lr_replans")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kind != ADAMW:
            raise ValueError(f"AdamWConfig.kind is {ADAMW!r}, got {self.kind!r}")

    def leaf_group(self, key: str, shape: tuple[int, ...]) -> str:
        return ADAMW

    def transformation(self) -> Any:
        # JAX and optax: only where a step is compiled (the config is read by the planner and the CLI)
        from marin.training.optimizers.updates import adamw

        return adamw(self)
