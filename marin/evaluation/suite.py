"""A training run's eval suite: which sets and tasks, windowed and packed how, and the record it makes (no JAX).

The in-training eval (``marin.training.trainer``) and the standalone eval step
(``marin.inference.evaluate``) both build the suite with :func:`prepare_run_suite` and score it with
:func:`marin.evaluation.evaluator.evaluate_prepared`, and both prepare multiple-choice tasks with
:func:`marin.evaluation.multiple_choice.prepare_run_tasks` and score them with
:func:`marin.evaluation.multiple_choice.score_prepared_task`, with the same sequence length (the run's
longest training sequence), the same rows per batch (the run's tokens per step, rounded to the mesh)
and the same packing, so an in-training record at step N and the standalone evaluation of
checkpoint N on the same pool are the same computation.

What is read of the run is only its config's data, sequence-length phases and tokens per step
(:class:`RunShape`), so this module knows nothing of training and training imports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from marin.evaluation.sets import Documents, EvalSet, load_eval_sets, mixture_validation_sets, run_tokenizer
from marin.evaluation.windows import PackedRows, pack_windows


class RunShape(Protocol):
    """What the suite reads of a training run's config (``marin.training.config.TrainConfig`` has it)."""

    @property
    def data(self) -> Any:
        """A mixture config (token stores, held-out split) or synthetic data."""

    @property
    def seq_len_phases(self) -> tuple[tuple[float, int], ...]:
        """``(fraction of the run, sequence length)`` phases."""

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step: one eval batch holds about as many."""


@dataclass(frozen=True)
class PreparedSuite:
    """Every set of a suite, windowed and packed once; evaluate it with
    :func:`marin.evaluation.evaluator.evaluate_prepared`."""

    rows: PackedRows
    set_names: list[str]
    sequence_set: np.ndarray  # int64 [n_sequences]: index into set_names
    sequence_tokens: np.ndarray  # int64 [n_sequences]: scored targets
    set_documents: np.ndarray
    set_bytes: np.ndarray
    seq_len: int
    batch_rows: int

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_tokens.sum())


def prepare_suite(
    sets: dict[str, Documents], seq_len: int, batch_rows: int, stride: int | None = None
) -> PreparedSuite:
    """Window and pack every document of every set (documents never share a window)."""
    names = sorted(sets)
    seqs: list[np.ndarray] = []
    owner: list[int] = []
    for k, name in enumerate(names):
        d = sets[name]
        eos = np.array([d.eos_id], np.int32)
        for t in d.tokens:
            seqs.append(np.concatenate([eos, t.astype(np.int32)]))
            owner.append(k)
    rows = pack_windows(seqs, seq_len, stride).padded_to(batch_rows)
    return PreparedSuite(
        rows=rows, set_names=names, sequence_set=np.array(owner, np.int64),
        sequence_tokens=np.array([len(s) - 1 for s in seqs], np.int64),
        set_documents=np.array([len(sets[n].tokens) for n in names], np.int64),
        set_bytes=np.array([int(sets[n].bytes.sum()) for n in names], np.int64),
        seq_len=seq_len, batch_rows=batch_rows,
    )


def default_batch_rows(tokens_per_batch: int, seq_len: int, mesh) -> int:
    """Rows per eval batch: about ``tokens_per_batch`` tokens, a multiple of the mesh's devices."""
    n = 1 if mesh is None else mesh.size
    rows = max(1, tokens_per_batch // seq_len)
    return max(n, rows // n * n)


def run_eval_sets(run: RunShape, sets: tuple = (), held_out: bool = True) -> tuple[EvalSet, ...]:
    """The sets a run is evaluated on: ``sets`` plus, for a mixture, its held-out split (``val/...``)."""
    extra = mixture_validation_sets(run.data) if held_out and hasattr(run.data, "stores") else ()
    return tuple(sets) + tuple(extra)


def eval_seq_len(run: RunShape) -> int:
    """Evaluation windows are as long as the run's longest training sequences."""
    return max(int(n) for _, n in run.seq_len_phases)


def run_batch_rows(run: RunShape, seq_len: int, mesh) -> int:
    """Rows per eval batch of a run: about its tokens per step, a multiple of the mesh's devices."""
    return default_batch_rows(run.tokens_per_step, seq_len, mesh)


def prepare_run_suite(run: RunShape, sets: tuple[EvalSet, ...], mesh, stride: int | None = None,
                      seq_len: int | None = None) -> PreparedSuite:
    """Load, window and pack ``sets`` for a run (tokenizer checked against the run's)."""
    if not sets:
        raise ValueError("nothing to evaluate: no eval sets (and the run's data has no held-out split)")
    docs = load_eval_sets(sets, tokenizer=run_tokenizer(run.data))
    seq_len = seq_len or eval_seq_len(run)
    return prepare_suite(docs, seq_len, run_batch_rows(run, seq_len, mesh), stride)


TASK_KEY = "eval/task/{name}/{metric}"
"""Where an in-training eval record carries a multiple-choice task's result (metric: one of :data:`TASK_METRICS`)."""

TASK_METRICS = ("acc", "acc_norm", "gold_bpb")
"""The task results an in-training eval record carries (questions and chance do not change during a run)."""


def metrics_record(step: int, tokens: int, suite: dict[str, Any] | None = None,
                   tasks: Mapping[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The ``metrics.jsonl`` record of an in-training eval (``kind: "eval"``, flat keys for W&B) of a
    suite's metrics (:func:`marin.evaluation.metrics.suite_metrics`; None when the run scores tasks
    only) and of each task's result (:func:`marin.evaluation.multiple_choice.score_prepared_task`)
    under :data:`TASK_KEY`."""
    rec: dict[str, Any] = {"step": int(step), "tokens": int(tokens), "kind": "eval"}
    if suite is not None:
        rec["eval/macro_bpb"] = suite["macro_bpb"]
        rec["eval/micro_bpb"] = suite["micro_bpb"]
        for name, m in suite["sets"].items():
            rec[f"eval/{name}/bpb"] = m["bpb"]
            rec[f"eval/{name}/loss"] = m["loss"]
    for name, result in sorted((tasks or {}).items()):
        for metric in TASK_METRICS:
            rec[TASK_KEY.format(name=name, metric=metric)] = result[metric]
    return rec
