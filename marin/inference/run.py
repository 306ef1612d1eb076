"""Loading a training run's model on one host.

Everything that uses a trained model in this process (``marin sample``, ``marin export``,
``marin harness``) calls :func:`load_run`; it and the eval step (:mod:`marin.inference.evaluate`,
every process of a pool) open the run as a :class:`marin.training.run.Run` and restore through
:meth:`Run.load <marin.training.run.Run.load>`, so when checkpoints change format only that changes.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from marin.evaluation.sets import load_run_tokenizer
from marin.pools import DEVICE_COUNT_FLAG, PoolSpec, as_pool, host_env
from marin.training.checkpoint.format import CorruptCheckpointError
from marin.training.config import TrainConfig, train_config_from_record
from marin.training.run import Run

logger = logging.getLogger(__name__)

T = TypeVar("T")


class RunLoadError(FileNotFoundError):
    """A run directory without the checkpoint asked for (no such directory, none committed, not at
    that step, or the one asked for is damaged): a FileNotFoundError, so the CLI prints one line."""


def committed_run_steps(run_dir: str) -> list[int]:
    """The committed checkpoint steps of ``run_dir``, ascending; :class:`RunLoadError` saying which
    is the case for a directory that does not exist and for one without a committed checkpoint."""
    run = Run(run_dir)
    if not run.exists:
        raise RunLoadError(f"no such directory: {run_dir} (pass a training step's output directory; "
                           "`marin status` lists them)")
    steps = run.committed_steps
    if not steps:
        raise RunLoadError(f"{run_dir} has no committed checkpoint (is it a training step's output directory?)")
    return steps


def load_verified_checkpoint(run_dir: str, step: int | None, load: Callable[[int], T], *,
                             flag: str = "--step", agree: Callable[[bool], bool] | None = None,
                             say: Callable[[str], None] | None = None) -> tuple[int, T]:
    """``(step, load(step))`` for the checkpoint of ``run_dir`` that verifies: the one asked for, or
    (``step=None``) the newest committed one whose data reads back.

    Training moves a damaged checkpoint aside and resumes from the one before; a reader (sample,
    eval, export, harness) must not change the run, so it leaves the damaged one where it is, says
    so in one warning line naming it, and uses the newest older one that verifies. A damaged
    checkpoint asked for by step is refused in one line naming ``flag`` with an older step, never
    silently replaced. ``load`` raises :class:`CorruptCheckpointError` for data that does not verify
    (a flipped byte, a truncated chunk, a missing part record). ``agree`` (every process of a pool
    calls this): True only where every process read its slices of a checkpoint cleanly, since each
    process reads only its own slices and a damaged chunk may be one host's alone. ``say``: where the
    warning line goes (default: this module's logger)."""
    steps = committed_run_steps(run_dir)
    checkpoint_path = Run(run_dir).checkpoint_path
    if step is not None and step not in steps:
        raise RunLoadError(f"{run_dir} has no committed checkpoint at step {step}; committed: {steps}")
    candidates = [step] if step is not None else list(reversed(steps))
    damaged: list[str] = []
    for s in candidates:
        try:
            result, problem = load(s), None
        except CorruptCheckpointError as e:
            result, problem = None, e
        if agree is not None and not agree(problem is None):
            problem = problem or CorruptCheckpointError(f"{checkpoint_path(s)}: another process of the "
                                                        "pool could not read its part")
        if problem is None:
            if damaged:
                line = f"{'; '.join(damaged)}; using step {s}, the newest checkpoint that verifies"
                (say or logger.warning)(line)
            return s, result
        reason = str(problem).removeprefix(f"{checkpoint_path(s)}: ")
        damaged.append(f"checkpoint {checkpoint_path(s)} is damaged ({reason}) and was skipped")
        if step is not None:
            older = [x for x in steps if x < step]
            hint = f"pass {flag} {older[-1]} for the one before it" if older else "it is the run's only checkpoint"
            raise RunLoadError(f"checkpoint {checkpoint_path(s)} is damaged ({reason}); {hint}")
    raise RunLoadError(f"no checkpoint of {run_dir} verifies: " + "; ".join(d.removesuffix(" and was skipped")
                                                                           for d in damaged))


@dataclass
class LoadedRun:
    """A run's model at one committed checkpoint, placed for ``mesh`` (None: one device)."""

    run_dir: str
    step: int
    checkpoint: str
    cfg: Any  # MoEConfig: the resolved model the run trained
    params: Any
    router_bias: Any
    metadata: dict[str, Any]  # the checkpoint's metadata (config record, tokens, ...)
    tokenizer: Any  # LoadedTokenizer, or None for a run on synthetic tokens
    mesh: Any = None

    @property
    def record(self) -> dict[str, Any]:
        """The training config the run recorded (what ``marin show`` prints)."""
        return self.metadata.get("config") or {}

    @property
    def train_config(self) -> TrainConfig:
        """The :class:`TrainConfig` that wrote this checkpoint, read back from its record."""
        return train_config_from_record(self.record)

    def require_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(f"{self.run_dir} was trained on synthetic tokens (no tokenizer): it cannot read or "
                             "write text; pass token ids instead")
        return self.tokenizer


def single_host_pool(pool: str | PoolSpec | Mapping[str, Any]) -> PoolSpec:
    """The pool (a command line's name, or the spec a run's record holds) if it has one host; else a
    one-line ValueError: :func:`load_run` holds the model in this one process."""
    spec = as_pool(pool)
    if spec.hosts != 1:
        raise ValueError(f"pool {spec.name} has {spec.hosts} hosts, and this command holds the model in one "
                         "process: pass --pool with a single-host pool (e.g. local-cpu-1, local-cpu or h200-1)")
    return spec


def prepare_devices(pool) -> None:
    """Fake CPU devices must be requested before JAX starts (a no-op once it has). A device count
    already in ``XLA_FLAGS`` is kept; without one, the pool's count joins the flags that are there."""
    if "jax" in sys.modules:
        return
    for k, v in host_env(pool).items():
        if k == "XLA_FLAGS" and DEVICE_COUNT_FLAG not in os.environ.get(k, ""):
            os.environ[k] = v
        else:
            os.environ.setdefault(k, v)


def load_run(run_dir: str, step: int | None = None, pool: str | PoolSpec | None = None, *,
             say: Callable[[str], None] | None = None) -> LoadedRun:
    """The model of ``run_dir`` (a training step's output directory, any fsspec path) at committed
    checkpoint ``step`` (None: the newest that verifies, see :func:`load_verified_checkpoint`), on
    ``pool`` (None: the run's own; it must be one host, since this process holds the model).

    The model is restored through the sharded checkpoint restore (``load_model``): on a multi-device
    pool each device reads only its own slices; on one device the model is read whole.
    Raises :class:`RunLoadError` for a run without that checkpoint."""
    return load_verified_checkpoint(run_dir, step, lambda s: _load_step(run_dir, s, pool), say=say)[1]


def _load_step(run_dir: str, step: int, pool: str | PoolSpec | None) -> LoadedRun:
    run = Run(run_dir)
    pool_spec = single_host_pool(pool or run.record(step).get("pool") or "local-cpu-1")
    prepare_devices(pool_spec)
    # JAX only now, after the pool's (fake) device count is set
    import jax

    from marin.parallel.mesh import make_mesh  # JAX (see above)

    mesh = make_mesh(*pool_spec.mesh)
    if mesh.size == 1:
        # one device: read the model whole (it has to fit that device anyway) and put it there
        model = run.load(step)
        mesh = None
        params, bias = jax.device_put(model.params), jax.device_put(model.router_bias)
    else:
        # each device gets only its slices, whatever pool wrote the checkpoint
        model = run.load(step, mesh)
        params, bias = model.params, model.router_bias
    return LoadedRun(run_dir, step, model.path, model.config, params, bias, model.metadata,
                     load_run_tokenizer(run.config(step).data), mesh)
