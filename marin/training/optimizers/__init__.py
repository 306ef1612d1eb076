"""The optimizers a run can train with, one module each (JAX-free configs; their updates are in
:mod:`marin.training.optimizers.updates`). ``TrainConfig.optimizer`` holds one of them, tagged by
each config's ``kind``: any config in the registry :data:`OPTIMIZERS`.

To add one: a frozen dataclass deriving :class:`~marin.training.optimizers.base.OptimizerBase` in its
own module, with a ``kind`` field of its own ``Literal`` tag, its groups (``leaf_group``), its state's
bytes per element by group (``STATE_BYTES``) and its update (``transformation``), registered with
:func:`register_optimizer` (the shipped ones are imported here, so importing the package registers
them). The config's type and groups, its record, the planner, the checkpoint's size, the
compiled-program caches, the trainer's step and ``marin plan --optimizer`` need nothing more.
"""

from __future__ import annotations

from typing import Any

from marin.training.optimizers.adamw import ADAMW, AdamWConfig
from marin.training.optimizers.base import OPTIMIZERS, OptimizerBase, optimizer_type, register_optimizer
from marin.training.optimizers.muonh import MUONH, MuonHConfig, heuristic_hyperparameters

OptimizerConfig = OptimizerBase
"""What ``TrainConfig.optimizer`` holds, as an annotation: any registered optimizer (checked when the
config is built; :func:`optimizer_type` is the union of the registered ones, for a reader or a parser)."""

def optimizer_from(value: Any) -> OptimizerBase:
    """An optimizer config from a config or a dict (a parsed command line, a record): the dict's
    ``kind`` picks the class (none: AdamW, what every run recorded before optimizers had a kind)."""
    if isinstance(value, OptimizerBase):
        if OPTIMIZERS.get(getattr(value, "kind", None)) is not type(value):
            raise ValueError(f"optimizer {type(value).__qualname__} is not registered: call "
                             f"register_optimizer({type(value).__qualname__}) in its module")
        return value
    if isinstance(value, dict):
        kind = value.get("kind", ADAMW)
        if kind not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer kind {kind!r}; choose from {sorted(OPTIMIZERS)}")
        return OPTIMIZERS[kind](**value)
    if isinstance(value, str) and value in OPTIMIZERS:  # the kind's name where its config belongs
        raise ValueError(f"optimizer must be an optimizer config, got the name {value!r}: write "
                         f"optimizer={OPTIMIZERS[value].__name__}(...) with its learning rates")
    classes = " or ".join(f"{c.__name__}(...)" for c in OPTIMIZERS.values())
    raise ValueError(f"optimizer must be an optimizer config ({classes}), got {type(value).__name__} {value!r}")


def kind_of_record(record: Any) -> str:
    """The optimizer ``kind`` a recorded config's ``optimizer`` names (AdamW for records made before
    the tag existed)."""
    return str((record or {}).get("kind", ADAMW)) if isinstance(record, dict) else ADAMW


__all__ = ["ADAMW", "MUONH", "OPTIMIZERS", "AdamWConfig", "MuonHConfig", "OptimizerBase", "OptimizerConfig",
           "heuristic_hyperparameters", "kind_of_record", "optimizer_from", "optimizer_type", "register_optimizer"]
