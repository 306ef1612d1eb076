"""Loading a training run's model on one host.

Everything that uses a trained model in this process (``marin sample``, ``marin export``,
``marin harness``) calls :func:`load_run`; it and the eval step (:mod:`marin.inference.evaluate`,
every process of a pool) restore through :func:`marin.training.checkpoint.load_model`, so when
checkpoints change format only that function changes.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from marin.evaluation.sets import load_run_tokenizer
from marin.training.checkpoint import (
    CorruptCheckpointError,
    checkpoint_path,
    checkpoint_step,
    committed_steps,
    load_model,
    read_metadata,
)
from marin.training.config import train_config_from_record
from marin.training.pools import get_pool, host_env


class RunLoadError(FileNotFoundError):
    """A run directory without the checkpoint asked for (none committed, not at that step, or damaged)."""


T = TypeVar("T")


def _say_on_stderr(line: str) -> None:
    print(line, file=sys.stderr)


def with_verified_checkpoint(run_dir: str, step: int | None, use: Callable[[int], T], *, flag: str = "--step",
                             say: Callable[[str], None] = _say_on_stderr) -> T:
    """``use(step)`` on a committed checkpoint of ``run_dir`` that verifies; what every command that
    reads a run's model (sample, eval, export, harness) goes through.

    ``step`` None: the newest committed checkpoint, and if reading it raises
    :class:`CorruptCheckpointError` (a flipped byte fails its chunk's checksum, a part record is
    missing) the next older one, with one line through ``say`` naming the damaged checkpoint, the way
    training falls back on restore. The damaged one is left where it is: these commands only read the
    run. ``step`` given: that checkpoint or a one-line :class:`RunLoadError` naming it and ``flag``
    (the option that picks another). A run without any checkpoint that verifies is a
    :class:`RunLoadError` naming each damaged one."""
    if step is not None:
        try:
            checkpoint_step(run_dir, step)
        except FileNotFoundError as e:
            raise RunLoadError(str(e)) from None
        try:
            return use(step)
        except CorruptCheckpointError as e:
            others = [s for s in committed_steps(run_dir) if s != step]
            hint = f"pass {flag} N for another committed one ({', '.join(map(str, others))})" if others else \
                "it is the run's only committed checkpoint"
            raise RunLoadError(f"checkpoint {step} of {run_dir} is damaged ({e}); {hint}") from None
    steps = committed_steps(run_dir)
    if not steps:
        try:
            checkpoint_step(run_dir, None)  # its message says what the directory holds
        except FileNotFoundError as e:
            raise RunLoadError(str(e)) from None
    damaged = []
    for s in reversed(steps):
        try:
            return use(s)
        except CorruptCheckpointError as e:
            damaged.append(s)
            older = [o for o in steps if o < s]
            if older:
                say(f"checkpoint {s} of {run_dir} is damaged ({e}); using checkpoint {older[-1]} instead "
                    f"(pass {flag} N to choose)")
    raise RunLoadError(f"no committed checkpoint of {run_dir} verifies (damaged: {', '.join(map(str, damaged))}); "
                       "the run has to be retrained from its last good state or its checkpoints restored from a copy")


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

    def require_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(f"{self.run_dir} was trained on synthetic tokens (no tokenizer): it cannot read or "
                             "write text; pass token ids instead")
        return self.tokenizer


def single_host_pool(name: str):
    """The pool ``name`` if it has one host; else a one-line ValueError: :func:`load_run` holds the
    model in this one process."""
    spec = get_pool(name)
    if spec.hosts != 1:
        raise ValueError(f"pool {spec.name} has {spec.hosts} hosts, and this command holds the model in one "
                         "process: pass --pool with a single-host pool (e.g. local-cpu-1, local-cpu or h200-1)")
    return spec


def _prepare_devices(pool) -> None:
    """Fake CPU devices must be requested before JAX starts (a no-op once it has)."""
    if "jax" in sys.modules:
        return
    for k, v in host_env(pool).items():
        os.environ.setdefault(k, v)


def load_run(run_dir: str, step: int | None = None, pool: str | None = None, *,
             say: Callable[[str], None] = _say_on_stderr) -> LoadedRun:
    """The model of ``run_dir`` (a training step's output directory, any fsspec path) at committed
    checkpoint ``step`` (None: the latest), on ``pool`` (None: the run's own; it must be one host,
    since this process holds the model).

    The model is restored through the sharded checkpoint restore (``load_model``): on a multi-device
    pool each device reads only its own slices; on one device the model is read whole.
    A damaged newest checkpoint falls back to the previous one (:func:`with_verified_checkpoint`).
    Raises :class:`RunLoadError` for a run without that checkpoint."""
    return with_verified_checkpoint(run_dir, step, lambda s: _load_step(run_dir, s, pool), say=say)


def _load_step(run_dir: str, step: int, pool: str | None) -> LoadedRun:
    path = checkpoint_path(run_dir, step)
    record = read_metadata(path).get("config") or {}
    pool_spec = single_host_pool(pool or record.get("pool") or "local-cpu-1")
    _prepare_devices(pool_spec)
    # JAX only now, after the pool's (fake) device count is set
    import jax

    from marin.parallel.mesh import make_mesh  # JAX (see above)

    train_config = train_config_from_record(record)
    mesh = make_mesh(*pool_spec.mesh)
    if mesh.size == 1:
        # one device: read the model whole (it has to fit that device anyway) and put it there
        model = load_model(run_dir, None, step=step)
        mesh = None
        params, bias = jax.device_put(model.params), jax.device_put(model.router_bias)
    else:
        # each device gets only its slices, whatever pool wrote the checkpoint
        model = load_model(run_dir, mesh, step=step)
        params, bias = model.params, model.router_bias
    return LoadedRun(run_dir, step, path, model.config, params, bias, model.metadata,
                     load_run_tokenizer(train_config.data), mesh)

