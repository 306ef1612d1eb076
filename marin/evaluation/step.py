"""Evaluating a training run: the standalone eval step (``eval.json``) and the in-training eval.

Both go through :func:`prepare_run_suite` and :func:`evaluate_prepared`, with the same sequence
length (the run's longest training sequence), the same rows per batch (the run's tokens per step,
rounded to the mesh) and the same packing, so an in-training record at step N and the standalone
evaluation of checkpoint N on the same pool are the same computation.

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

from marin.evaluation.metrics import SetTotals, suite_metrics
from marin.evaluation.sets import (
    EvalSet,
    load_eval_sets,
    mixture_validation_sets,
    run_tokenizer,
)
from marin.execution.versioning import by_field, input_field, live

logger = logging.getLogger(__name__)

EVAL_FILE = "eval.json"


# ---- what a run's checkpoints say about it -------------------------------------------------------
def train_config_from_record(record: dict[str, Any]):
    """A :class:`TrainConfig` with the model, schedule and data of a checkpoint's config record."""
    from marin.data.mixture import MixtureConfig
    from marin.models.config import MoEConfig
    from marin.training.config import SyntheticDataConfig, TrainConfig

    model = record["model"]
    if isinstance(model, dict):  # the resolved model the run trained (older records hold a preset name)
        model = MoEConfig(**model)
    data = record.get("data") or {}
    if "stores" in data:
        data = MixtureConfig(stores=tuple(data["stores"]), validation_fraction=data["validation_fraction"],
                             validation_min_documents=data["validation_min_documents"],
                             validation_max_documents=data["validation_max_documents"])
    elif data:
        data = SyntheticDataConfig(**data)
    return TrainConfig(
        output_path=record["output_path"], data=data, model=model, preset=record.get("preset"),
        model_overrides=dict(record.get("model_overrides") or {}), pool=record["pool"],
        tokens_per_step=int(record["tokens_per_step"]), compute_dtype=record.get("compute_dtype"),
        seq_len_phases=tuple((float(f), int(n)) for f, n in record["seq_len_phases"]),
    )


def committed_steps(run_path: str) -> list[int]:
    """Steps of the run's committed checkpoints, ascending (half-written ones are never listed)."""
    from marin.training.checkpoint import CheckpointManager, CheckpointPolicy

    return CheckpointManager(run_path, CheckpointPolicy()).committed_steps()


def checkpoint_path(run_path: str, step: int) -> str:
    from marin.training.checkpoint import CheckpointManager, CheckpointPolicy

    return CheckpointManager(run_path, CheckpointPolicy()).path_for(step)


def select_steps(run_path: str, checkpoint: str | int) -> list[int]:
    """Which committed checkpoints ``checkpoint`` ("latest", "all" or a step number) names."""
    steps = committed_steps(run_path)
    if not steps:
        raise FileNotFoundError(f"{run_path} has no committed checkpoint (is it a training step's output directory?)")
    if checkpoint == "latest":
        return steps[-1:]
    if checkpoint == "all":
        return steps
    try:
        step = int(checkpoint)
    except (TypeError, ValueError):
        raise ValueError(f"checkpoint must be 'latest', 'all' or a step number, got {checkpoint!r}") from None
    if step not in steps:
        raise FileNotFoundError(f"{run_path} has no committed checkpoint at step {step}; committed: {steps}")
    return [step]


def load_model_state(path: str, cfg, mesh=None) -> tuple[Any, Any, dict[str, Any]]:
    """``(params, router_bias, metadata)`` of a committed checkpoint (its optimizer state is not read),
    restored onto ``mesh`` whatever pool wrote it: each process reads only the slices its devices hold
    (marin.training.checkpoint). ``mesh=None`` reads them whole into this process (tests, exports)."""
    import jax

    from marin.models.transformer import init_params, init_router_bias
    from marin.training.checkpoint import CheckpointMismatchError, restore_checkpoint

    template = {"params": jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0))),
                "router_bias": jax.eval_shape(lambda: init_router_bias(cfg))}
    shardings = None
    if mesh is not None:
        from marin.parallel.mesh import param_shardings, replicated

        shardings = {"params": param_shardings(template["params"], mesh), "router_bias": replicated(mesh)}
    try:
        tree, meta = restore_checkpoint(path, template, shardings, partial=True)
    except CheckpointMismatchError as e:
        raise ValueError(f"not a checkpoint of this model: {e}") from None
    return tree["params"], tree["router_bias"], meta


# ---- one suite for a run ----------------------------------------------------------------------------
def run_eval_sets(train_config, sets: tuple = (), held_out: bool = True) -> tuple[EvalSet, ...]:
    """The sets a run is evaluated on: ``sets`` plus, for a mixture, its held-out split (``val/...``)."""
    extra = mixture_validation_sets(train_config.data) if held_out and hasattr(train_config.data, "stores") else ()
    return tuple(sets) + tuple(extra)


def eval_seq_len(train_config) -> int:
    """Evaluation windows are as long as the run's longest training sequences."""
    return max(int(n) for _, n in train_config.seq_len_phases)


def prepare_run_suite(train_config, sets, mesh, stride: int | None = None, seq_len: int | None = None):
    """Load, window and pack ``sets`` for a run (tokenizer checked against the run's)."""
    from marin.evaluation.evaluator import default_batch_rows, prepare_suite

    if not sets:
        raise ValueError("nothing to evaluate: no eval sets (and the run's data has no held-out split)")
    docs = load_eval_sets(sets, tokenizer=run_tokenizer(train_config.data))
    seq_len = seq_len or eval_seq_len(train_config)
    return prepare_suite(docs, seq_len, default_batch_rows(train_config.tokens_per_step, seq_len, mesh), stride)


def suite_record(totals: dict[str, SetTotals]) -> dict[str, Any]:
    """``{"sets", "macro_bpb", "micro_bpb"}`` of per-set totals."""
    return suite_metrics(totals)


def metrics_record(step: int, tokens: int, suite: dict[str, Any]) -> dict[str, Any]:
    """The ``metrics.jsonl`` record of an in-training eval (``kind: "eval"``, flat keys for W&B)."""
    rec: dict[str, Any] = {"step": int(step), "tokens": int(tokens), "kind": "eval",
                           "eval/macro_bpb": suite["macro_bpb"], "eval/micro_bpb": suite["micro_bpb"]}
    for name, m in suite["sets"].items():
        rec[f"eval/{name}/bpb"] = m["bpb"]
        rec[f"eval/{name}/loss"] = m["loss"]
    return rec


# ---- the standalone step ----------------------------------------------------------------------------
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
    pool: str | None = live("where the evaluation runs; the scores do not depend on it", default=None)
    seq_len: int | None = None
    stride: int | None = None
    tasks: dict[str, str] = field(default_factory=dict)
    """Multiple-choice tasks, name -> jsonl path (marin.evaluation.multiple_choice); results under "tasks"."""


def evaluate_checkpoints_on_host(ctx, config: EvalConfig, steps: list[int]) -> dict[str, Any]:
    """Host function (every process of the pool runs it): evaluate each of ``steps``."""
    from marin.evaluation.evaluator import evaluate_prepared
    from marin.parallel.mesh import make_mesh
    from marin.training.checkpoint import read_metadata

    first = read_metadata(checkpoint_path(config.run_path, steps[-1]))
    train_config = train_config_from_record(first["config"])
    cfg = train_config.model  # exactly the model the run trained (its record holds the resolved config)
    mesh = make_mesh(*ctx.pool.mesh)
    sets = run_eval_sets(train_config, config.sets, config.held_out)
    suite = prepare_run_suite(train_config, sets, mesh, config.stride, config.seq_len) if sets else None
    if suite is None and not config.tasks:
        raise ValueError("nothing to evaluate: no eval sets, no held-out split and no tasks")
    tasks = _load_tasks(train_config, config.tasks)
    records = []
    for step in steps:
        path = checkpoint_path(config.run_path, step)
        params, bias, meta = load_model_state(path, cfg, mesh)
        rec = {"step": step, "checkpoint": path, "train_tokens": int(meta.get("tokens", 0))}
        if suite is not None:
            rec.update(suite_record(evaluate_prepared(params, bias, suite, cfg, mesh)))
        if tasks:
            rec["tasks"] = _score_tasks(tasks, params, bias, cfg, mesh, train_config, config.seq_len)
        if suite is not None:
            logger.info("eval of %s: macro bpb %.4f, micro bpb %.4f", path, rec["macro_bpb"], rec["micro_bpb"])
        records.append(rec)
    out = dict(records[-1])
    if config.checkpoint == "all":
        out["checkpoints"] = records
    if suite is not None:
        out["eval_tokens"] = suite.num_tokens
        out["seq_len"] = suite.seq_len
    return out


def _load_tasks(train_config, tasks: dict[str, str]):
    """(tokenizer, {name: questions}) of the run's tokenizer and the task files, or None."""
    if not tasks:
        return None
    from marin.data.store import TokenStore
    from marin.data.tokenizer import load_tokenizer
    from marin.evaluation.multiple_choice import read_task

    stores = getattr(train_config.data, "stores", None)
    if not stores:
        raise ValueError("the run was trained on synthetic tokens (no tokenizer); it cannot score text tasks")
    tok = load_tokenizer(TokenStore.open(stores[0]).manifest["tokenizer"]["path"])
    return tok, {name: read_task(path) for name, path in sorted(tasks.items())}


def _score_tasks(tasks, params, bias, cfg, mesh, train_config, seq_len: int | None) -> dict[str, Any]:
    from marin.evaluation.evaluator import default_batch_rows
    from marin.evaluation.multiple_choice import score_task

    tok, questions = tasks
    seq_len = seq_len or eval_seq_len(train_config)
    rows = default_batch_rows(train_config.tokens_per_step, seq_len, mesh)
    return {name: score_task(qs, tok, params, bias, cfg, mesh, seq_len, rows) for name, qs in questions.items()}


def run_eval(config: EvalConfig, *, use_ray: bool | None = None) -> dict[str, Any]:
    """Evaluate on the configured (or the run's) pool; returns the eval.json object (not written)."""
    import ray

    from marin.training.checkpoint import read_metadata
    from marin.training.pools import get_pool, launch, run_local

    steps = select_steps(config.run_path, config.checkpoint)
    pool = get_pool(config.pool or read_metadata(checkpoint_path(config.run_path, steps[-1]))["config"]["pool"])
    if use_ray if use_ray is not None else ray.is_initialized():
        return launch(pool, evaluate_checkpoints_on_host, (config, steps))[0]
    return run_local(pool, evaluate_checkpoints_on_host, (config, steps))


def evaluate(config: EvalConfig) -> dict[str, Any]:
    """Executor step: evaluate and write ``eval.json`` in the step's output directory."""
    import fsspec

    result = run_eval(config)
    with fsspec.open(f"{config.output_path.rstrip('/')}/{EVAL_FILE}", "w") as f:
        json.dump(result, f, indent=1)
    return {k: result[k] for k in ("step", "macro_bpb", "micro_bpb", "tasks") if k in result}
