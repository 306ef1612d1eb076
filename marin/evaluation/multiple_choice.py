"""Multiple-choice log-likelihood tasks, scored the way lm-eval-harness scores them.

A task is a jsonl file (any fsspec path, optionally .gz/.zst), one question per line::

    {"context": "Council note. Vote on the", "choices": [" budget", " sky", " river"], "gold": 0}

(``query`` is accepted for ``context`` and ``label`` for ``gold``.) Each choice's log-likelihood is
the summed log-probability of its tokens given ``[EOS] + context``, with the pair encoded as the
harness does: the whole ``context + choice`` is tokenized and the choice's tokens are what follows
the context's own tokens (so a merge across the boundary is scored as the choice's). A context too
long for the window keeps its last tokens.

    acc       = mean over questions of [argmax_i loglik_i == gold]
    acc_norm  = mean over questions of [argmax_i loglik_i / utf8_bytes(choice_i) == gold]

``chance`` is the mean of 1 / number of choices. ``gold_bpb`` is the *task loss* of the scaling
literature (Bhagia et al. 2024, "Establishing Task Scaling Laws via Compute-Efficient Model
Ladders"): the correct choice's negative log-likelihood in bits per UTF-8 byte of the choice, averaged
over questions. It moves smoothly with scale where accuracy jumps, so a ladder fits it against compute
and accuracy against it.

A task scored against many weights is tokenized and packed once: :func:`prepare_run_tasks` (a
run's tasks, with its tokenizer, window length and eval batch) or :func:`prepare_task`, then
:func:`score_prepared_task` per checkpoint (the eval step) or per in-training eval (the trainer).

:func:`write_domain_task` builds a task from the K40 miniature's domain languages (continue a
passage in its own domain's language), so a tiny ladder has a task that its models can learn.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np

from marin.data.synthetic import generate_documents
from marin.evaluation.sets import load_run_tokenizer
from marin.evaluation.suite import RunShape, eval_seq_len, run_batch_rows
from marin.evaluation.windows import PackedRows, pack_windows
from marin.execution.versioning import input_field


class TaskError(ValueError):
    """A task file that cannot be scored (missing, empty, or a malformed line)."""


@dataclass(frozen=True)
class Question:
    context: str
    choices: tuple[str, ...]
    gold: int


def read_task(path: str) -> list[Question]:
    """Questions of a task file; a malformed line raises :class:`TaskError` naming it."""
    out = []
    try:
        with fsspec.open(path, "rb", compression="infer") as f:
            lines = f.read().decode("utf-8").splitlines()
    except FileNotFoundError:
        raise TaskError(f"task file not found: {path}") from None
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            ctx = d["context"] if "context" in d else d["query"]
            gold = int(d["gold"] if "gold" in d else d["label"])
            choices = tuple(str(c) for c in d["choices"])
        except (KeyError, TypeError, ValueError) as e:
            raise TaskError(f"{path} line {i}: needs context, choices and gold ({type(e).__name__}: {e})") from None
        if len(choices) < 2 or not 0 <= gold < len(choices):
            raise TaskError(f"{path} line {i}: needs >= 2 choices and 0 <= gold < {len(choices)}, got gold={gold}")
        out.append(Question(str(ctx), choices, gold))
    if not out:
        raise TaskError(f"task {path} has no questions")
    return out


def encode_pair(tok, context: str, choice: str) -> tuple[list[int], list[int]]:
    """(context tokens, choice tokens) as the harness splits them; trailing context spaces move to the choice."""
    n = len(context) - len(context.rstrip(" "))
    if n:
        context, choice = context[:-n], context[-n:] + choice
    whole, ctx = tok.encode_batch([context + choice, context])
    return ctx, whole[len(ctx):] if whole[:len(ctx)] == ctx else tok.encode_batch([choice])[0]


def choice_logliks(questions: list[Question], tok, params, router_bias, cfg, mesh, seq_len: int,
                   batch_rows: int) -> list[np.ndarray]:
    """Per question, the log-likelihood (nats) of each choice given its context."""
    task = prepare_task(questions, tok, seq_len, batch_rows)
    return _per_question(questions, packed_logliks(task.pairs, params, router_bias, cfg, mesh))


def _per_question(questions: list[Question], loglik: np.ndarray) -> list[np.ndarray]:
    out, k = [], 0
    for q in questions:
        out.append(loglik[k:k + len(q.choices)])
        k += len(q.choices)
    return out


@dataclass(frozen=True)
class PackedPairs:
    """``(context, continuation)`` requests tokenized and packed into window rows once, so the same
    requests score against many weights (every in-training eval, every checkpoint) without
    re-tokenizing."""

    rows: PackedRows
    count: int
    batch_rows: int


def pack_pairs(pairs: list[tuple[str, str]], tok, seq_len: int, batch_rows: int) -> PackedPairs:
    """Tokenize each pair as the harness splits it (:func:`encode_pair`) and pack the
    ``[EOS] + context + continuation`` sequences several to a window row, only the continuation scored."""
    seqs, score_from = [], []
    for n, (context, continuation) in enumerate(pairs):
        ctx, cont = encode_pair(tok, context, continuation)
        if not cont:
            raise TaskError(f"request {n}: continuation {continuation!r} has no tokens")
        if len(cont) > seq_len:
            raise TaskError(f"request {n}: continuation of {len(cont)} tokens is longer than the window ({seq_len})")
        s = np.array([tok.eos_id, *ctx, *cont], np.int32)
        keep = min(len(s), seq_len + 1)
        seqs.append(s[-keep:])
        score_from.append(keep - len(cont))
    rows = pack_windows(seqs, seq_len, score_from=score_from).padded_to(batch_rows)
    return PackedPairs(rows, len(seqs), batch_rows)


def packed_logliks(packed: PackedPairs, params, router_bias, cfg, mesh, greedy: bool = False):
    """log P(continuation | [EOS] + context) (nats) of each packed pair; with ``greedy`` also whether
    each continuation is the model's argmax at every one of its tokens, as a pair of arrays."""
    from marin.evaluation.evaluator import sequence_nll  # JAX: reading and packing tasks must not import it

    res = sequence_nll(params, router_bias, packed.rows, packed.count, cfg, mesh, packed.batch_rows, greedy=greedy)
    return (-res[0], res[1]) if greedy else -res


def pair_logliks(pairs: list[tuple[str, str]], tok, params, router_bias, cfg, mesh, seq_len: int, batch_rows: int,
                 greedy: bool = False):
    """log P(continuation | [EOS] + context) (nats) of each ``(context, continuation)`` pair, packed
    several to a window row; with ``greedy`` also whether each continuation is the model's argmax at
    every one of its tokens, as a pair of arrays. The one scorer behind multiple-choice tasks and the
    lm-evaluation-harness adapter."""
    return packed_logliks(pack_pairs(pairs, tok, seq_len, batch_rows), params, router_bias, cfg, mesh, greedy)


def accuracy(questions: list[Question], logliks: list[np.ndarray]) -> dict[str, Any]:
    """acc, acc_norm (log-likelihood per UTF-8 byte of the choice) and chance. Pure."""
    acc = acc_norm = 0
    for q, ll in zip(questions, logliks, strict=True):
        nbytes = np.array([max(1, len(c.encode("utf-8"))) for c in q.choices], np.float64)
        acc += int(np.argmax(ll)) == q.gold
        acc_norm += int(np.argmax(ll / nbytes)) == q.gold
    n = len(questions)
    return {"questions": n, "acc": acc / n, "acc_norm": acc_norm / n,
            "chance": float(np.mean([1.0 / len(q.choices) for q in questions]))}


def gold_bpb(questions: list[Question], logliks: list[np.ndarray]) -> float:
    """Mean over questions of the correct choice's negative log-likelihood in bits per UTF-8 byte of
    the choice (the task loss). Pure."""
    vals = [-float(ll[q.gold]) / (math.log(2) * max(1, len(q.choices[q.gold].encode("utf-8"))))
            for q, ll in zip(questions, logliks, strict=True)]
    return float(np.mean(vals))


@dataclass(frozen=True)
class PreparedTask:
    """A task's questions with every ``(context, choice)`` pair tokenized and packed for one window
    length and eval batch (:func:`prepare_task`); :func:`score_prepared_task` scores it."""

    questions: list[Question]
    pairs: PackedPairs


def prepare_task(questions: list[Question], tok, seq_len: int, batch_rows: int) -> PreparedTask:
    """Tokenize and pack a task once (no JAX)."""
    return PreparedTask(questions, pack_pairs([(q.context, c) for q in questions for c in q.choices], tok, seq_len,
                                              batch_rows))


def score_prepared_task(task: PreparedTask, params, router_bias, cfg, mesh) -> dict[str, Any]:
    """accuracy, byte-normalised accuracy, chance and the task loss (``gold_bpb``) of a prepared task
    under ``params``: what the eval step records per checkpoint and the trainer per in-training eval.
    Every process of a mesh that spans processes calls it alike (each places its own shards)."""
    logliks = _per_question(task.questions, packed_logliks(task.pairs, params, router_bias, cfg, mesh))
    return {**accuracy(task.questions, logliks), "gold_bpb": gold_bpb(task.questions, logliks)}


def score_task(questions: list[Question], tok, params, router_bias, cfg, mesh, seq_len: int,
               batch_rows: int) -> dict[str, Any]:
    """:func:`score_prepared_task` of ``questions`` prepared for this one scoring."""
    return score_prepared_task(prepare_task(questions, tok, seq_len, batch_rows), params, router_bias, cfg, mesh)


def prepare_run_tasks(run: RunShape, tasks: Mapping[str, str], mesh, seq_len: int | None = None
                      ) -> dict[str, PreparedTask]:
    """Multiple-choice tasks (name -> jsonl path) read, tokenized with the run's tokenizer and packed
    once, for the run's window length (or ``seq_len``) and eval batch; ``{}`` without tasks."""
    if not tasks:
        return {}
    tok = load_run_tokenizer(run.data)
    if tok is None:
        raise ValueError("the run was trained on synthetic tokens (no tokenizer); it cannot score text tasks")
    seq_len = seq_len or eval_seq_len(run)
    rows = run_batch_rows(run, seq_len, mesh)
    return {name: prepare_task(read_task(path), tok, seq_len, rows) for name, path in sorted(tasks.items())}


@dataclass(frozen=True)
class DomainTaskConfig:
    """A continuation task over the K40 miniature's domain languages (written as ``task.jsonl``).

    Each question's context is the first ``context_words`` words of a fresh q5 document's body
    (document ``start`` onwards: never in the training corpus when ``start`` is beyond its size);
    the choices are the next ``choice_words`` words of that document and of the documents at the same
    index in ``n_choices - 1`` other domains. ``seed`` must be the corpus's: it defines the languages.
    """

    output_path: str = input_field()
    domains: tuple[str, ...]
    questions_per_domain: int = 16
    n_choices: int = 4
    seed: int = 0
    start: int = 50_000
    context_words: int = 8
    choice_words: int = 6


def domain_task_questions(config: DomainTaskConfig) -> list[dict[str, Any]]:
    """The task's questions as jsonl records (pure)."""
    doms = tuple(config.domains)
    if len(doms) < config.n_choices or config.n_choices < 2:
        raise TaskError(f"a domain task with {config.n_choices} choices needs at least that many domains "
                        f"(and >= 2), got {len(doms)}")
    need = config.context_words + config.choice_words
    bodies = {d: [t.split("\n", 1)[-1].split() for t in generate_documents(
        d, "q5", config.questions_per_domain, seed=config.seed, start=config.start)] for d in doms}
    out = []
    for i in range(config.questions_per_domain):
        for gi, d in enumerate(doms):
            # the gold domain and the next n_choices - 1 domains (cyclically), gold at a rotating slot
            others = [doms[(gi + k) % len(doms)] for k in range(1, config.n_choices)]
            slot = (i + gi) % config.n_choices
            picks = others[:slot] + [d] + others[slot:]
            if any(len(bodies[o][i]) < need for o in picks):
                continue
            out.append({"context": " ".join(bodies[d][i][:config.context_words]),
                        "choices": [" " + " ".join(bodies[o][i][config.context_words:need]) for o in picks],
                        "gold": slot})
    if not out:
        raise TaskError(f"no document of {doms} is long enough for {need} words")
    return out


def write_domain_task(config: DomainTaskConfig) -> dict[str, Any]:
    """Executor step: write ``task.jsonl`` (see :class:`DomainTaskConfig`)."""
    qs = domain_task_questions(config)
    with fsspec.open(f"{config.output_path.rstrip('/')}/task.jsonl", "w") as f:
        f.write("".join(json.dumps(q) + "\n" for q in qs))
    return {"questions": len(qs)}
