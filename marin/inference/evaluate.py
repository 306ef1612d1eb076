"""The eval step: committed checkpoints of a training step scored on eval sets and tasks (``eval.json``).

It restores the run's checkpoints (:meth:`marin.training.run.Run.load`) and runs on the
run's pool (or another) through :mod:`marin.pools`, so it sits above training, like the
harness step (:mod:`marin.inference.harness`). The suite is the one the in-training eval scores
(:mod:`marin.evaluation.suite`), so an in-training record at step N and this step's record of
checkpoint N on the same pool are the same computation.

``eval.json`` (one record, or with ``checkpoint="all"`` the latest record plus ``checkpoints``)::

    {"step": 600, "checkpoint": ".../checkpoints/step-00000600", "train_tokens": 2457600,
     "sets": {"val/council": {"documents", "tokens", "bytes", "loss", "perplexity", "bpb"}, ...},
     "macro_bpb": 2.31, "micro_bpb": 2.29, "checkpoints": [record, ...]}
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

import fsspec
import numpy as np

from marin.evaluation.metrics import suite_metrics
from marin.evaluation.multiple_choice import prepare_run_tasks, score_prepared_task
from marin.evaluation.sets import EvalSet
from marin.evaluation.suite import prepare_run_suite, run_eval_sets
from marin.execution.versioning import by_field, input_field, live
from marin.inference.run import load_verified_checkpoint
from marin.pools import HostContext, PoolSpec, as_pool, launch, run_local
from marin.training.run import Run

logger = logging.getLogger(__name__)

EVAL_FILE = "eval.json"


@dataclass(frozen=True)
class EvalConfig:
    """Evaluate committed checkpoints of the training step at ``run_path``; writes ``eval.json``.

    ``checkpoint``: "latest", a step number, or "all" (every retained checkpoint, in step order).
    ``pool``: None runs on the training run's pool. ``held_out``: add the run's mixture held-out split.
    ``seq_len``: None = the run's longest training sequence; ``stride``: None = disjoint windows.
    """

    run_path: str = input_field()
    output_path: str = input_field()
    sets: tuple[EvalSet, ...] = by_field("each eval set's fields are versioned leaves (sets[0].name)", default=())
    checkpoint: str | int = "latest"
    held_out: bool = False
    pool: PoolSpec | None = live("where the evaluation runs; the scores do not depend on it", default=None)
    """The pool itself (a name given here is resolved to its PoolSpec when the config is built)."""
    seq_len: int | None = None
    stride: int | None = None
    tasks: dict[str, str] = field(default_factory=dict)
    """Multiple-choice tasks, name -> jsonl path (marin.evaluation.multiple_choice); results under "tasks"."""

    def __post_init__(self) -> None:
        if self.pool is not None:
            object.__setattr__(self, "pool", as_pool(self.pool))  # resolved once, here: the spec travels


def evaluate_checkpoints_on_host(ctx: HostContext, config: EvalConfig, steps: list[int]) -> dict[str, Any]:
    """Host function (every process of the pool runs it): evaluate each of ``steps``."""
    # JAX only on the pool's hosts: experiment files import this module to plan the step without it
    from marin.evaluation.evaluator import evaluate_prepared
    from marin.parallel.mesh import make_mesh  # JAX (see above)

    run = Run(config.run_path)
    train_config = run.config(steps[-1])
    mesh = make_mesh(*ctx.pool.mesh)
    sets = run_eval_sets(train_config, config.sets, config.held_out)
    suite = prepare_run_suite(train_config, sets, mesh, config.stride, config.seq_len) if sets else None
    if suite is None and not config.tasks:
        raise ValueError("nothing to evaluate: no eval sets, no held-out split and no tasks")
    tasks = prepare_run_tasks(train_config, config.tasks, mesh, config.seq_len)  # tokenized once, for every step
    records = []
    for step in steps:
        # exactly the model the run trained (its record); "latest" is the newest checkpoint that verifies
        wanted = None if config.checkpoint in ("latest", None) else step
        step, model = load_verified_checkpoint(config.run_path, wanted,
                                               lambda s: run.load(s, mesh),
                                               agree=every_process_agrees(ctx))
        rec = {"step": step, "checkpoint": model.path, "train_tokens": int(model.metadata.get("tokens", 0))}
        if suite is not None:
            rec.update(suite_metrics(evaluate_prepared(model.params, model.router_bias, suite, model.config, mesh)))
            logger.info("eval of %s: macro bpb %.4f, micro bpb %.4f", model.path, rec["macro_bpb"], rec["micro_bpb"])
        if tasks:
            rec["tasks"] = {name: score_prepared_task(task, model.params, model.router_bias, model.config, mesh)
                            for name, task in tasks.items()}
        records.append(rec)
    out = dict(records[-1])
    if config.checkpoint == "all":
        out["checkpoints"] = records
    if suite is not None:
        out["eval_tokens"] = suite.num_tokens
        out["seq_len"] = suite.seq_len
    return out


def every_process_agrees(ctx: HostContext):
    """None on one process; else a vote that is True only where every process of the pool says True
    (each reads only its own slices of a checkpoint, so damage may show on one host alone)."""
    if ctx.num_processes == 1:
        return None
    from jax.experimental import multihost_utils  # JAX: on the pool's hosts only (see above)

    return lambda ok: bool(np.all(multihost_utils.process_allgather(np.asarray(ok, dtype=np.int32))))


def run_eval(config: EvalConfig, *, use_ray: bool | None = None) -> dict[str, Any]:
    """Evaluate on the configured (or the run's) pool; returns the eval.json object (not written)."""
    import ray  # Ray: only to launch on a pool; declaring an eval step must not import it

    run = Run(config.run_path)
    steps = run.select(config.checkpoint)
    pool = config.pool or as_pool(run.record(steps[-1])["pool"])  # the run's record holds its spec whole
    if use_ray if use_ray is not None else ray.is_initialized():
        return launch(pool, evaluate_checkpoints_on_host, (config, steps), step_dir=config.output_path)[0]
    return run_local(pool, evaluate_checkpoints_on_host, (config, steps))


def evaluate(config: EvalConfig) -> dict[str, Any]:
    """Executor step: evaluate and write ``eval.json`` in the step's output directory."""
    result = run_eval(config)
    with fsspec.open(f"{config.output_path.rstrip('/')}/{EVAL_FILE}", "w") as f:
        json.dump(result, f, indent=1)
    return {k: result[k] for k in ("step", "macro_bpb", "micro_bpb", "tasks") if k in result}
