"""What every optimizer of a run shares, JAX-free: the learning-rate schedule, and the questions the
trainer, the compiled-program caches, the memory planner and the checkpoint code ask of an optimizer.

An optimizer is a frozen dataclass deriving :class:`OptimizerBase`. Its fields are its settings (all
versioned, except ``lr_replans``, which moves the horizon of a live run); it answers:

* ``kind``: the tag of the tagged union ``TrainConfig.optimizer`` holds (``"adamw"``, ``"muonh"``);
* :meth:`~OptimizerBase.leaf_group`: which parameter group a parameter leaf belongs to (by the
  leaf's role in the model's parameter table, :func:`marin.models.params.role_of` of its key
  ``"blocks/wq"``, ``"embed"``);
* :attr:`~OptimizerBase.STATE_BYTES`: the bytes of optimizer state each group keeps per parameter
  element (float32 moments and momentum buffers), so the planner counts ``optimizer_state`` and
  the checkpoint's size leaf by leaf; :attr:`~OptimizerBase.NEWTON_SCHULZ_GROUPS`: the groups whose
  update orthogonalises each matrix (the planner counts their temporaries);
* :meth:`~OptimizerBase.transformation`: the update as an optax transformation (JAX, built only
  where a step is compiled): ``update(grads, state, params, lr=...)`` returns the change of every
  parameter, which the step adds to it. ``lr`` is the schedule's value at the step, computed on the
  host (:func:`marin.training.schedule.lr_at`), so a re-planned horizon needs no recompilation;
* :meth:`~OptimizerBase.program_key`: the config with the fields only the host-side schedule reads
  reset, which keys the compiled-program caches (every other field, including one added tomorrow,
  is in the key without a line to keep in step).

Its state's shardings follow the parameters': every state tree mirrors the parameters' dict (a
subset of its leaves, under the same keys), so the layout's rule, by each leaf's role
(:func:`marin.parallel.mesh.param_shardings`), places each moment like its parameter.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, ClassVar

from marin.execution.fieldcheck import check_fields
from marin.execution.versioning import live
from marin.training.schedule import DEFAULT_FINAL_LR_FRACTION, LRSchedule, Replan

LR_REPLANS_REASON = ("(at_step, new_total_steps): moving the horizon of a running run; the schedule before the "
                     "re-plan point is unchanged and the run resumes from its checkpoints")

# MuonH's group names and its Newton-Schulz coefficients, here because its JAX-free config
# (marin.training.optimizers.muonh) and its update (marin.training.optimizers.updates) both read them
MUONH_GROUP, ADAMH_GROUP, ADAM_GROUP = "muonh", "adamh", "adam"
NEWTON_SCHULZ_COEFFS = (3.4445, -4.7750, 2.0315)
"""The quintic iteration's coefficients X <- a X + (b A + c A^2) X, A = X X^T (Keller Jordan's Muon)."""

SCHEDULE_FIELDS = ("warmup_steps", "final_lr_fraction", "lr_replans")
"""Fields only the host-side schedule reads: the compiled step never sees them (it is fed the LR)."""


def pairs(value: Any) -> Any:
    """``lr_replans`` in one spelling (the version encodes it): a tuple of ``(int, int)`` tuples."""
    if isinstance(value, (list, tuple)):
        return tuple((int(a), int(b)) for a, b in value)
    return value


@dataclasses.dataclass(frozen=True)
class OptimizerBase:
    """The learning-rate schedule every optimizer shares: linear warmup to ``peak_lr`` over
    ``warmup_steps``, linear decay to ``final_lr_fraction`` x peak at the horizon
    (``TrainConfig.train_steps``); ``lr_replans`` moves the horizon of a running run
    (:class:`marin.training.schedule.LRSchedule`, built by :meth:`lr_schedule`)."""

    peak_lr: float = 3e-3
    warmup_steps: int = 10
    final_lr_fraction: float = DEFAULT_FINAL_LR_FRACTION
    lr_replans: tuple[tuple[int, int], ...] = live(LR_REPLANS_REASON, default=())

    STATE_BYTES: ClassVar[dict[str, int]] = {}
    """Bytes of optimizer state per parameter element, by group."""
    NEWTON_SCHULZ_GROUPS: ClassVar[tuple[str, ...]] = ()
    """Groups whose update orthogonalises each matrix by Newton-Schulz iterations."""
    PROGRAM_ONLY_SCHEDULE: ClassVar[tuple[str, ...]] = SCHEDULE_FIELDS
    """Fields the compiled programs do not read (reset in :meth:`program_key`)."""

    FIELD_RANGES: ClassVar[dict[str, str]] = {"peak_lr": "> 0", "warmup_steps": ">= 0", "final_lr_fraction": "[0, 1]"}
    """Each numeric field's range (:func:`marin.execution.fieldcheck.check_fields`; its type is checked
    by its annotation); an optimizer adds its own fields' ranges to these."""

    def __post_init__(self) -> None:
        check_fields(self, "optimizer.", self.FIELD_RANGES)
        try:
            object.__setattr__(self, "lr_replans", pairs(self.lr_replans))
        except (TypeError, ValueError):
            raise ValueError(f"optimizer.lr_replans must be (at_step, new_total_steps) pairs of whole numbers, got "
                             f"{self.lr_replans!r}") from None

    def lr_schedule(self, train_steps: int) -> LRSchedule:
        """The schedule over a run of ``train_steps`` planned steps (re-plans included)."""
        return LRSchedule(peak_lr=self.peak_lr, warmup_steps=self.warmup_steps, total_steps=train_steps,
                          final_fraction=self.final_lr_fraction,
                          replans=tuple(Replan(int(a), int(t)) for a, t in self.lr_replans))

    def leaf_group(self, key: str, shape: tuple[int, ...]) -> str:
        """The parameter group of leaf ``key`` (``"blocks/wq"``) of ``shape``."""
        raise NotImplementedError

    def state_bytes(self, key: str, shape: tuple[int, ...]) -> int:
        """Bytes of optimizer state per element of leaf ``key``."""
        return self.STATE_BYTES[self.leaf_group(key, shape)]

    def program_key(self) -> OptimizerBase:
        """This config with the fields no compiled program reads reset to their defaults: what keys
        the trainer's compiled init and step programs (a re-planned horizon reuses them)."""
        defaults = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
                    for f in dataclasses.fields(self) if f.name in self.PROGRAM_ONLY_SCHEDULE}
        return dataclasses.replace(self, **defaults)

    def transformation(self) -> Any:
        """The update as an optax ``GradientTransformationExtraArgs`` (``update(..., lr=...)`` gives the
        parameters' change)."""
        raise NotImplementedError


OPTIMIZERS: dict[str, type[OptimizerBase]] = {}
"""The registry: each optimizer's config class by its ``kind``, filled by :func:`register_optimizer`.
``TrainConfig.optimizer`` accepts, reads back from a record and groups exactly these; ``marin plan
--optimizer`` offers them; docs/versioning.md lists their fields."""


def register_optimizer(cls: type[OptimizerBase]) -> type[OptimizerBase]:
    """Register an optimizer config class under its ``kind`` (the default of its ``kind`` field), once,
    at the end of its module (usable as a class decorator). Registering it is all a run needs: the
    config, its record, its groups, the planner, the checkpoint and ``marin plan`` read the registry."""
    if not (isinstance(cls, type) and issubclass(cls, OptimizerBase) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"register_optimizer takes an OptimizerBase dataclass, got {cls!r}")
    kind_field = {f.name: f for f in dataclasses.fields(cls)}.get("kind")
    kind = None if kind_field is None else kind_field.default
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"{cls.__name__} needs a kind field whose default is its tag (kind: Literal[\"name\"] = "
                         "\"name\") to be registered")
    if OPTIMIZERS.get(kind, cls) is not cls:
        raise ValueError(f"optimizer kind {kind!r} is taken by {OPTIMIZERS[kind].__qualname__}; "
                         f"give {cls.__qualname__} a kind of its own")
    OPTIMIZERS[kind] = cls
    return cls


def optimizer_type() -> Any:
    """The union of the registered optimizer configs, as a type: what a record reader or a command-line
    parser (draccus) reads ``TrainConfig.optimizer`` as (a dict picks the member its ``kind`` or its
    fields name)."""
    return typing.Union[tuple(OPTIMIZERS.values())]  # noqa: UP007 - built from the registry at call time
