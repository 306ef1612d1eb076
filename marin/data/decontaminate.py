"""The decontamination step: training documents that share an n-gram with an evaluation set removed.

Every evaluation document and every task question (its prompt with its correct answer) is cut into
word ``ngram``-grams after the normalisation the dedup step uses (:func:`marin.data.dedup.normalize_words`);
their 64-bit hashes, each with the set of evaluation sets it came from, form one sorted table (small:
evaluation sets are megabytes). One task per corpus file then hashes the document's n-grams and looks
them up: a document with a hit is removed (``mode="remove"``), or the words of every matching n-gram
are cut out of its text (``mode="cut"``; a document left with no words is removed). Evaluation texts
shorter than ``ngram`` words cannot be matched and are counted in the manifest as ``too_short``.

Input and output are in the layout the tokenize step reads; the output keeps every field of every
kept record. Restart, corrupt input and empty input behave as in every corpus step (see
:mod:`marin.data.corpus_steps`); ``decontamination_manifest.json`` is written last and counts, per
evaluation set, its documents, n-grams and the training documents that matched it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
import zlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np

from marin.data.corpus_steps import (
    WORK_DIR,
    CorpusInput,
    CorpusStep,
    CorpusStepError,
    InputFile,
    file_task,
    fingerprint,
    input_group,
    run_tasks,
    summarize,
    write_kept_records,
)
from marin.data.dedup import mix64, normalize_words, word_spans
from marin.data.readers import iter_documents, iter_record_lines, list_document_files
from marin.execution.versioning import input_field, live

logger = logging.getLogger(__name__)

DECON_MANIFEST = "decontamination_manifest.json"
MODES = ("remove", "cut")
REASON_CONTAMINATED = "contaminated"
MAX_EVAL_SETS = 64  # one bit per evaluation set in the n-gram table


class DecontaminationError(CorpusStepError):
    """The step cannot produce a decontaminated corpus; the message says why (each failed file named)."""


STEP = CorpusStep("decontaminate", DecontaminationError, DECON_MANIFEST, "decontamination_failures.json")


# --------------------------------------------------------------------------------------------------
# n-gram hashing (pure functions)

_POW = mix64(np.arange(1, 257, dtype=np.uint64)) | np.uint64(1)  # odd multipliers, one per n-gram position


def word_hashes(words: Sequence[str]) -> np.ndarray:
    """A stable 64-bit hash per word (two CRC-32s; Python's own hash is salted per process)."""
    lo = np.fromiter((zlib.crc32(w.encode("utf-8")) for w in words), dtype=np.uint64, count=len(words))
    hi = np.fromiter((zlib.crc32(w.encode("utf-8"), 0x5BD1E995) for w in words), dtype=np.uint64, count=len(words))
    return lo | (hi << np.uint64(32))


def ngram_hashes(words: Sequence[str], n: int) -> np.ndarray:
    """The hash of every word ``n``-gram, in order (none when there are fewer than ``n`` words)."""
    if len(words) < n:
        return np.zeros(0, dtype=np.uint64)
    if n > _POW.size:
        raise ValueError(f"ngram must be at most {_POW.size}")
    h = word_hashes(words)
    m = len(words) - n + 1
    acc = np.zeros(m, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            acc += h[j:j + m] * _POW[j]
    return mix64(acc)


def eval_texts(record: Mapping[str, Any], text_field: str) -> list[str]:
    """The texts of one evaluation record that must not be trained on: the document text, or a
    task's prompt with its answer (``context`` + the gold choice; ``prompt``/``question`` +
    ``answer``)."""
    out = []
    if isinstance(record.get(text_field), str):
        out.append(record[text_field])
    prompt = next((record[k] for k in ("context", "prompt", "question") if isinstance(record.get(k), str)), None)
    answer = record.get("answer")
    if "choices" in record and ("gold" in record or "label" in record):
        try:
            answer = record["choices"][int(record.get("gold", record.get("label")))]
        except (IndexError, TypeError, ValueError):
            answer = None
    if prompt is not None:
        out.append(prompt + (" " + str(answer) if answer is not None else ""))
    return out


def build_ngram_table(against: Mapping[str, Sequence[str]], n: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """(sorted unique n-gram hashes, uint64 bitmask of the sets holding each, per-set counts) from
    ``{set name: texts}``."""
    if len(against) > MAX_EVAL_SETS:
        raise DecontaminationError(f"at most {MAX_EVAL_SETS} evaluation sets at once, got {len(against)}")
    keys, masks, stats = [], [], {}
    for bit, (name, texts) in enumerate(against.items()):
        hs = [ngram_hashes(normalize_words(t), n) for t in texts]
        short = sum(1 for h in hs if h.size == 0)
        k = np.unique(np.concatenate(hs)) if hs else np.zeros(0, np.uint64)
        keys.append(k)
        masks.append(np.full(k.size, np.uint64(1) << np.uint64(bit)))
        stats[name] = {"texts": len(texts), "too_short": short, "ngrams": int(k.size)}
    k = np.concatenate(keys) if keys else np.zeros(0, np.uint64)
    m = np.concatenate(masks) if masks else np.zeros(0, np.uint64)
    order = np.argsort(k, kind="stable")
    k, m = k[order], m[order]
    uniq, start = np.unique(k, return_index=True)
    mask = np.bitwise_or.reduceat(m, start) if k.size else np.zeros(0, np.uint64)
    return uniq, mask, stats


def ngram_hits(hashes: np.ndarray, table: np.ndarray, masks: np.ndarray) -> tuple[np.ndarray, int]:
    """(positions of ``hashes`` found in the table, OR of the matching sets' bits)."""
    if hashes.size == 0 or table.size == 0:
        return np.zeros(0, dtype=np.int64), 0
    pos = np.minimum(np.searchsorted(table, hashes), table.size - 1)
    found = table[pos] == hashes
    hit = np.flatnonzero(found)
    bits = int(np.bitwise_or.reduce(masks[pos[hit]])) if hit.size else 0
    return hit, bits


def cut_spans(text: str, spans: Sequence[tuple[int, int]]) -> str:
    """``text`` without the character ranges ``spans`` (overlapping ranges merged), each cut replaced by
    one space."""
    out, at = [], 0
    for s, e in sorted(spans):
        if e <= at:
            continue
        if s < at:  # overlaps the previous cut: extend it
            at = e
            continue
        out.append(text[at:s])
        out.append(" ")
        at = e
    out.append(text[at:])
    return "".join(out).strip()


# --------------------------------------------------------------------------------------------------
# The step


@dataclass(frozen=True)
class DecontaminateConfig:
    """Remove (or cut) training text under ``input_path`` that overlaps the evaluation sets in ``against``.

    against: evaluation set name -> a file, directory or glob of jsonl / parquet files: documents
        (``input.text_field``) or task questions (``context``, ``choices``, ``gold``). A step's output
        enters the version through the step's hash; a plain path is versioned as the path.
    input: which sources and documents are read, the corrupt-input policy, and how the work is
        spread (:class:`~marin.data.corpus_steps.CorpusInput`).
    """

    input_path: str = input_field()
    output_path: str = input_field()
    against: dict[str, str] = dataclasses.field(default_factory=dict)
    input: CorpusInput = input_group()
    ngram: int = 13
    mode: str = "remove"
    """"remove": drop a document with any matching n-gram; "cut": cut the matching words out."""
    sample_matches: int = 20
    """Matched training documents listed in the manifest, with the evaluation sets they matched."""
    keep_work: bool = live("whether the n-gram table stays after success, not the output", default=False)


@dataclass(frozen=True)
class DeconTask:
    file: InputFile
    table_path: str
    work: str
    ngram: int
    mode: str
    text_field: str
    max_doc_bytes: int
    n_sets: int
    marker_fp: str


_TABLES: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # per worker process: the table is read once


def _table(path: str) -> tuple[np.ndarray, np.ndarray]:
    if path not in _TABLES:
        with fsspec.open(path, "rb") as f:
            z = np.load(f, allow_pickle=False)
            _TABLES.clear()
            _TABLES[path] = (z["keys"], z["masks"])
    return _TABLES[path]


def decontaminate_file(task: DeconTask) -> dict:
    """One corpus file: find documents sharing an n-gram with the table; write the rest (or the cut text)."""
    return file_task(task.file, f"{task.work}/written/{task.file.key}.json", task.marker_fp,
                     lambda: decontaminate_records(task))


def decontaminate_records(task: DeconTask) -> dict:
    f = task.file
    table, masks = _table(task.table_path)
    drop: list[int] = []
    replace: dict[int, str] = {}
    skipped: Counter = Counter()
    per_set = [0] * task.n_sets
    n_in = bytes_in = bytes_out = 0
    removed = removed_bytes = cut = cut_bytes = 0
    sample = []
    for rec in iter_documents(f.url, task.text_field, task.max_doc_bytes):
        if rec.skip is not None:
            skipped[rec.skip] += 1
            drop.append(rec.index)
            continue
        n_in += 1
        bytes_in += rec.nbytes
        spans = word_spans(rec.text) if task.mode == "cut" else None
        words = [w for w, _, _ in spans] if spans is not None else normalize_words(rec.text)
        hit, bits = ngram_hits(ngram_hashes(words, task.ngram), table, masks)
        if not hit.size:
            bytes_out += rec.nbytes
            continue
        for b in range(task.n_sets):
            per_set[b] += (bits >> b) & 1
        if len(sample) < 3:
            first = int(hit[0])
            sample.append({"record": rec.index, "sets": bits,
                           "ngram": " ".join(words[first:first + task.ngram])})
        if task.mode == "cut":
            kept = cut_spans(rec.text, [(spans[i][1], spans[i + task.ngram - 1][2]) for i in hit.tolist()])
            if normalize_words(kept):
                replace[rec.index] = kept
                nb = len(kept.encode("utf-8"))
                cut += 1
                cut_bytes += rec.nbytes - nb
                bytes_out += nb
                continue
        drop.append(rec.index)
        removed += 1
        removed_bytes += rec.nbytes
    write_kept_records(f.url, f.output, drop, task.text_field, replace)
    return {"documents_in": n_in, "bytes_in": bytes_in, "documents_out": n_in - removed, "bytes_out": bytes_out,
            "removed": {REASON_CONTAMINATED: removed}, "removed_bytes": {REASON_CONTAMINATED: removed_bytes},
            "cut_documents": cut, "cut_bytes": cut_bytes, "skipped": dict(skipped), "per_set": per_set,
            "sample": sample}


def read_eval_texts(location: str, text_field: str) -> list[str]:
    """Every text to protect in one evaluation set (a file, directory or glob of document files)."""
    fs, p = fsspec.core.url_to_fs(location)
    if any(c in location for c in "*?["):
        files = sorted(fs.unstrip_protocol(x) if "://" in location else x for x in fs.glob(p))
    else:
        files = list_document_files(location) or ([location] if fs.isfile(p) else [])
    if not files:
        raise DecontaminationError(f"evaluation set {location}: no jsonl or parquet files there")
    texts: list[str] = []
    for url in files:
        if ".parquet" in url.rsplit("/", 1)[-1]:
            texts.extend(r.text for r in iter_documents(url, text_field) if r.text is not None)
            continue
        for line in iter_record_lines(url):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                texts.extend(eval_texts(obj, text_field))
    return texts


def decontaminate(config: DecontaminateConfig) -> None:
    """Executor step: write the decontaminated corpus and ``decontamination_manifest.json``."""
    inputs = config.input
    inputs.validate()
    if config.mode not in MODES:
        raise DecontaminationError(f"mode must be one of {MODES}, got {config.mode!r}")
    if config.ngram < 1:
        raise DecontaminationError(f"ngram must be positive, got {config.ngram}")
    if not config.against:
        raise DecontaminationError("against is empty: name at least one evaluation set or task file to "
                                   "decontaminate against")
    t0 = time.monotonic()
    out = config.output_path.rstrip("/")
    work = f"{out}/{WORK_DIR}"
    files = STEP.plan(config.input_path, out, inputs)
    names = list(config.against)
    texts = {name: read_eval_texts(loc, inputs.text_field) for name, loc in config.against.items()}
    table, masks, set_stats = build_ngram_table(texts, config.ngram)
    if table.size == 0:
        counts = ", ".join(f"{n}: {s['texts']} texts" for n, s in set_stats.items())
        raise DecontaminationError(f"the evaluation sets hold no text of {config.ngram} words or more ({counts}); "
                                   "nothing to match")
    table_fp = hashlib.sha256(table.tobytes() + masks.tobytes()).hexdigest()[:16]
    table_path = f"{work}/eval_ngrams-{table_fp}.npz"
    fs, tp = fsspec.core.url_to_fs(table_path)
    if not fs.exists(tp):
        fs.makedirs(tp.rsplit("/", 1)[0], exist_ok=True)
        with fsspec.open(table_path, "wb") as f:
            np.savez(f, keys=table, masks=masks)
    tasks = [DeconTask(f, table_path, work, config.ngram, config.mode, inputs.text_field, inputs.max_doc_bytes,
                       len(names), fingerprint([table_fp, config.ngram, config.mode, inputs.text_field,
                                                inputs.max_doc_bytes, f.url, f.size, f.output]))
             for f in files]
    results = run_tasks(decontaminate_file, tasks, "decontaminate", inputs, sizes=[f.size for f in files])
    corrupt = STEP.check_failures(results, out, inputs.on_corrupt, inputs.max_corrupt_fraction)
    good = [r for r in results if not r.get("error")]
    summary = summarize(good, (REASON_CONTAMINATED,))
    totals = summary["totals"]
    STEP.check_documents(totals["documents_in"], totals["skipped"], len(good), config.input_path, inputs,
                         "no manifest was written")
    per_set = {name: {**set_stats[name], "matched_training_documents": sum(r["per_set"][i] for r in good)}
               for i, name in enumerate(names)}
    sample = []
    for r in good:
        for s in r["sample"]:
            if len(sample) < config.sample_matches:
                sample.append({"source": r["source"], "file": files[r["index"]].rel, "record": s["record"],
                               "sets": [n for i, n in enumerate(names) if (s["sets"] >> i) & 1], "ngram": s["ngram"]})
    summary["totals"]["cut_documents"] = sum(r["cut_documents"] for r in good)
    summary["totals"]["cut_bytes"] = sum(r["cut_bytes"] for r in good)
    summary["totals"]["skipped_files"] = len(corrupt)
    manifest = {
        "kind": "decontaminate",
        "input_path": config.input_path,
        "params": {"ngram": config.ngram, "mode": config.mode, "text_field": inputs.text_field,
                   "max_doc_bytes": inputs.max_doc_bytes, "on_corrupt": inputs.on_corrupt,
                   "max_corrupt_fraction": inputs.max_corrupt_fraction},
        "against": per_set,
        **summary,
        "sample": sample,
        "skipped_files": [{"source": r["source"], "input_file": r["url"], "reason": r["error"]} for r in corrupt],
        "seconds": round(time.monotonic() - t0, 3),
    }
    STEP.finish(out, manifest, config.keep_work)
    logger.info("decontaminate %s: %d -> %d documents, %s", out, summary["totals"]["documents_in"],
                summary["totals"]["documents_out"],
                ", ".join(f"{n} matched {s['matched_training_documents']}" for n, s in per_set.items()))

