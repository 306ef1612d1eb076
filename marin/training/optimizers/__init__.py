"""The optimizers a run can train with, one module each (JAX-free configs; their updates are in
:mod:`marin.training.optimizers.updates`). ``TrainConfig.optimizer`` holds one of them: the union
:data:`OptimizerConfig`, tagged by each config's ``kind``.

To add one: a frozen dataclass deriving :class:`~marin.training.optimizers.base.OptimizerBase` in its
own module, with a ``kind`` field of its own ``Literal`` tag, its groups (``leaf_group``), its state's
bytes per element by group (``STATE_BYTES``) and its update (``transformation``); then add it to
:data:`OPTIMIZERS` and to the union below. The planner, the checkpoint's size, the compiled-program
caches and the trainer's step need nothing more.
"""

from __future__ import annotations

from typing import Any

from marin.training.optimizers.adamw import ADAMW, AdamWConfig
from marin.training.optimizers.base import OptimizerBase
from marin.training.optimizers.muonh import MUONH, MuonHConfig, heuristic_hyperparameters

OptimizerConfig = AdamWConfig | MuonHConfig
"""What ``TrainConfig.optimizer`` holds (a tagged union: each member's ``kind``)."""

OPTIMIZERS: dict[str, type[OptimizerBase]] = {ADAMW: AdamWConfig, MUONH: MuonHConfig}
"""Each optimizer's config class by its ``kind``."""


def optimizer_from(value: Any) -> OptimizerBase:
    """An optimizer config from a config or a dict (a parsed command line, a record): the dict's
    ``kind`` picks the class (none: AdamW, what every run recorded before optimizers had a kind)."""
    if isinstance(value, OptimizerBase):
        return value
    if isinstance(value, dict):
        kind = value.get("kind", ADAMW)
        if kind not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer kind {kind!r}; choose from {sorted(OPTIMIZERS)}")
        return OPTIMIZERS[kind](**value)
    raise TypeError(f"TrainConfig.optimizer must be one of {[c.__name__ for c in OPTIMIZERS.values()]}, "
                    f"got {type(value).__name__}")


def kind_of_record(record: Any) -> str:
    """The optimizer ``kind`` a recorded config's ``optimizer`` names (AdamW for records made before
    the tag existed)."""
    return str((record or {}).get("kind", ADAMW)) if isinstance(record, dict) else ADAMW


__all__ = ["ADAMW", "MUONH", "OPTIMIZERS", "AdamWConfig", "MuonHConfig", "OptimizerBase", "OptimizerConfig",
           "heuristic_hyperparameters", "kind_of_record", "optimizer_from"]
