"""lm-evaluation-harness on a training run: ``marin harness`` and the harness eval step.

The model is loaded with :func:`marin.inference.load_run` and scored by
:class:`marin.evaluation.harness.MarinLM` with the run's evaluation window (its longest training
sequence, the window ``marin eval`` uses), so harness numbers and marin's own agree.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

import fsspec

from marin.evaluation.suite import eval_seq_len
from marin.execution.versioning import input_field, live
from marin.inference.multihost import run_pool
from marin.inference.run import load_run
from marin.pools import PoolSpec, as_pool

RESULTS_FILE = "harness.json"  # in the harness step's directory; the report reads it

ONE_HOST_ONLY = ("pool {pool} has {hosts} hosts, and lm-evaluation-harness drives the model from one Python "
                 "process (its request loop would have to run in lockstep on every host, which it does not "
                 "promise): pass --pool with a single-host pool (local-cpu, h200-1), or score multiple-choice "
                 "tasks on this pool with `marin eval --task`")
"""Why ``marin harness`` and the harness step refuse a pool of several hosts, in one line."""


def run_harness(run_dir: str, tasks: list[str], *, step: int | None = None, pool: str | PoolSpec | None = None,
                include_path: str | None = None, output_path: str | None = None,
                limit: int | None = None) -> dict[str, Any]:
    """lm_eval results of ``tasks`` on ``run_dir``'s checkpoint (``step``: None = the latest), on
    ``pool`` (None: the run's), which must have one host (see :data:`ONE_HOST_ONLY`)."""
    spec = run_pool(run_dir, step, pool)
    if spec.hosts > 1:  # refused before lm_eval (slow to import) is loaded
        raise ValueError(ONE_HOST_ONLY.format(pool=spec.name, hosts=spec.hosts))
    # lm_eval is an optional extra: imported when a harness runs, not when an experiment file loads
    from marin.evaluation.harness import MarinLM, check_tasks, evaluate_tasks

    check_tasks(tasks, include_path)  # bad task files fail before the model is loaded
    run = load_run(run_dir, step, spec)
    seq_len = eval_seq_len(run.train_config)
    lm = MarinLM(run.params, run.router_bias, run.cfg, run.require_tokenizer(), run.mesh, seq_len=seq_len)
    results = evaluate_tasks(lm, tasks, include_path=include_path, limit=limit, output_path=output_path)
    results["marin"] = {"run": run_dir, "step": run.step, "checkpoint": run.checkpoint, "seq_len": seq_len}
    return results


def task_files_fingerprint(include_path: str | None) -> str | None:
    """sha256 over the relative names and bytes of every file under ``include_path``: the step's
    version changes when a task's YAML or data changes, not only when its name does."""
    if include_path is None:
        return None
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(include_path):
        dirs.sort()
        for fname in sorted(files):
            path = os.path.join(root, fname)
            digest.update(os.path.relpath(path, include_path).encode() + b"\0")
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


@dataclass(frozen=True)
class HarnessConfig:
    """Run lm_eval ``tasks`` (from ``include_path``) on the training step at ``run_path``; writes
    ``harness.json`` (lm_eval's results object plus ``summary``) in ``output_path``."""

    run_path: str = input_field()
    output_path: str = input_field()
    tasks: tuple[str, ...] = ()
    include_path: str | None = live("where the task files are; their content is versioned by task_files",
                                    default=None)
    task_files: str | None = None
    """task_files_fingerprint(include_path): the tasks' YAML and data, versioned by content."""
    checkpoint: int | None = None  # None: the latest committed checkpoint
    limit: int | None = None
    pool: PoolSpec | None = live("where the harness runs; the scores do not depend on it", default=None)
    """The pool itself (a name given here is resolved to its PoolSpec when the config is built)."""

    def __post_init__(self) -> None:
        if self.pool is not None:
            object.__setattr__(self, "pool", as_pool(self.pool))  # resolved once, here: the spec travels


def harness_eval(config: HarnessConfig) -> dict[str, Any]:
    """Executor step: lm_eval results of the run's checkpoint, written as ``harness.json``."""
    from marin.evaluation.harness import summary  # lm_eval: an optional extra, loaded when a harness runs

    results = run_harness(config.run_path, list(config.tasks), step=config.checkpoint, pool=config.pool,
                          include_path=config.include_path, limit=config.limit)
    record = {"step": results["marin"]["step"], "summary": summary(results), "results": results.get("results"),
              "versions": results.get("versions"), "n-samples": results.get("n-samples"),
              "config": results.get("config"), "marin": results["marin"]}
    with fsspec.open(f"{config.output_path.rstrip('/')}/{RESULTS_FILE}", "w") as f:
        json.dump(record, f, indent=1, default=str)
    return {"step": record["step"], "summary": record["summary"]}
