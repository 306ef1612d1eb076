"""The K40 layout built from a labelled corpus: every document scored by the quality classifier, put in
one of 5 buckets by score quantiles, and written under ``{domain}/{bucket}/``, the directory
convention :func:`marin.data.k40.K40Layout` names and the tokenize step reads.

A corpus step in the frame of :mod:`marin.data.corpus_steps` (Ray tasks per file, resumable, the
corrupt-input policy, progress), in three phases:

1. **score**, one task per input file: each document's logit under the classifier
   (:mod:`marin.data.quality`), kept per record, and a histogram of the logits per domain (the
   domain from the assignment step, :mod:`marin.data.domains`) in bins of ``1 / BINS_PER_LOGIT``;
2. **thresholds**: the histograms summed (per domain, or over the corpus with ``bucketing="global"``)
   and cut at the 20/40/60/80% quantiles. A histogram, not a sort of every score, so the step's own
   memory does not grow with the corpus: a cut falls on a bin edge, so a bucket's share may be off its
   20% by the documents of one bin (the manifest records the shares the cuts gave);
3. **write**, one task per input file: each record (its bytes as read, every field kept; a parquet row
   as one JSON line) appended to ``{domain}/{bucket}/{file}.jsonl.gz`` (or the ``output_format``),
   with documents, bytes and, given a tokenizer, tokens counted per source.

``k40_manifest.json`` is written last (:func:`marin.data.k40.make_k40_manifest`'s format): counts
per source; the domains with their names, top terms and token shares; where the fit, the assignment
and the classifier came from (paths and content ids); the cuts; and an overview per domain (share,
top terms, quality distribution, score quantiles, a few sample documents) for a person to read.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import fsspec
import numpy as np

from marin.data.corpus_steps import (
    WORK_DIR,
    CorpusInput,
    CorpusStep,
    CorpusStepError,
    InputFile,
    OutputFile,
    file_task,
    fingerprint,
    input_group,
    run_tasks,
)
from marin.data.domains import document_batches, load_fit, read_assignment, read_labels
from marin.data.k40 import MANIFEST_NAME, QUALITY_BUCKETS, K40Domain, make_k40_manifest, source_name
from marin.data.quality import load_quality_model
from marin.data.readers import CorruptInputError, iter_record_lines
from marin.execution.versioning import input_field, live

logger = logging.getLogger(__name__)

BUCKETINGS = ("per_domain", "global")
OUTPUT_FORMATS = ("jsonl", "jsonl.gz", "jsonl.zst")
BINS_PER_LOGIT = 256
LOGIT_RANGE = 40.0
"""Logits are histogrammed in [-40, 40] (a logistic probability within 4e-18 of 0 or 1 beyond it)."""
N_BINS = int(2 * LOGIT_RANGE * BINS_PER_LOGIT)


class LayoutError(CorpusStepError):
    """The K40 layout cannot be built; the message says why."""


STEP = CorpusStep("k40 layout", LayoutError, MANIFEST_NAME, "k40_layout_failures.json")


def score_bins(logits: np.ndarray) -> np.ndarray:
    """The histogram bin of each logit (int32 in [0, N_BINS))."""
    b = np.floor((np.clip(logits, -LOGIT_RANGE, LOGIT_RANGE) + LOGIT_RANGE) * BINS_PER_LOGIT)
    return np.minimum(b, N_BINS - 1).astype(np.int32)


def quantile_cuts(hist: np.ndarray, n_buckets: int = len(QUALITY_BUCKETS)) -> np.ndarray:
    """The ``n_buckets - 1`` cut bins of a histogram: a document whose bin is at most ``cuts[j]`` is in
    a bucket below ``j + 1`` (cut j is the first bin where the cumulative count reaches (j+1)/n_buckets)."""
    cum = np.cumsum(hist)
    total = cum[-1] if cum.size else 0
    if total == 0:
        return np.zeros(n_buckets - 1, np.int32)
    return np.array([int(np.searchsorted(cum, total * j / n_buckets, side="left"))
                     for j in range(1, n_buckets)], np.int32)


def bucket_of(bins: np.ndarray, cuts: np.ndarray) -> np.ndarray:
    """Bucket index (0 = lowest quality) of each bin under ``cuts``."""
    return np.searchsorted(cuts, bins, side="left")


def bin_logit(b: float) -> float:
    """The logit at the upper edge of bin ``b``: what a cut means as a score."""
    return round((b + 1) / BINS_PER_LOGIT - LOGIT_RANGE, 4)


@dataclass(frozen=True)
class K40BuildConfig:
    """Score, bucket and lay out the corpus at ``input_path`` (the corpus the assignment at
    ``assignment_path`` labelled) with the classifier at ``classifier_path``."""

    input_path: str = input_field()
    assignment_path: str = input_field()
    classifier_path: str = input_field()
    output_path: str = input_field()
    input: CorpusInput = input_group()
    bucketing: str = "per_domain"
    """"per_domain": each domain's documents split into 5 equal buckets by their scores (every domain
    keeps all 5 buckets); "global": one set of cuts for the corpus (a domain of worse text has more
    of it in the low buckets)."""
    tokenizer: str | None = input_field(default=None)
    """A tokenizer (step or tokenizer.json path) to count tokens per source; None: not counted."""
    output_format: str = "jsonl.gz"
    samples_per_domain: int = 3
    """Documents per domain shown in the manifest's overview (the first in file order)."""
    sample_chars: int = 400
    keep_work: bool = live("whether the per-record scores stay after success, not the output", default=False)

    def validate(self) -> None:
        self.input.validate()
        if self.bucketing not in BUCKETINGS:
            raise LayoutError(f"bucketing must be one of {BUCKETINGS}, got {self.bucketing!r}")
        if self.output_format not in OUTPUT_FORMATS:
            raise LayoutError(f"output_format must be one of {OUTPUT_FORMATS}, got {self.output_format!r}")


def check_assignment(assignment: dict, files: Sequence[InputFile], inputs: CorpusInput, input_path: str,
                     assignment_path: str) -> set[str]:
    """Refuse an assignment made from other files or another reading of them (one line naming the
    first difference); return the keys of files the assignment skipped as corrupt."""
    labelled = {f["key"]: f for f in assignment["files"]}
    corrupt = {s["input_file"] for s in assignment.get("skipped_files", [])}
    where = f"the domain assignment at {assignment_path} was made"
    if assignment.get("text_field") != inputs.text_field or assignment.get("max_doc_bytes") != inputs.max_doc_bytes:
        raise LayoutError(f"{where} with text_field={assignment.get('text_field')!r}, max_doc_bytes="
                          f"{assignment.get('max_doc_bytes')}; this step reads text_field={inputs.text_field!r}, "
                          f"max_doc_bytes={inputs.max_doc_bytes}: give both the same CorpusInput")
    skip = set()
    for f in files:
        if f.url in corrupt:
            skip.add(f.key)
            continue
        got = labelled.pop(f.key, None)
        if got is None or got["size"] != f.size:
            why = "has no labels for it" if got is None else f"labelled {got['size']} bytes, it has {f.size}"
            raise LayoutError(f"{where} from other files than the corpus at {input_path} ({f.url}: the assignment "
                              f"{why}); assign domains to this corpus first")
    if labelled:
        raise LayoutError(f"{where} from other files than the corpus at {input_path} ({len(labelled)} labelled "
                          f"file(s) missing here, e.g. {next(iter(labelled))}); assign domains to this corpus first")
    return skip


# --------------------------------------------------------------------------------------------------
# Phase 1: scores


@dataclass(frozen=True)
class ScoreTask:
    file: InputFile
    work: str
    assignment_path: str
    classifier_path: str
    text_field: str
    max_doc_bytes: int
    marker_fp: str


def score_paths(work: str, key: str) -> dict[str, str]:
    base = f"{work}/scores/{key}"
    return {"scores": base + ".npy", "hist": base + ".hist.npz", "meta": base + ".json"}


def score_file(task: ScoreTask) -> dict:
    """Phase 1 for one file: every document's logit (NaN for a record that is not a document) and the
    histogram of its documents' bins per domain."""
    return file_task(task.file, score_paths(task.work, task.file.key)["meta"], task.marker_fp,
                     lambda: _score_file(task))


def _score_file(task: ScoreTask) -> dict:
    model = load_quality_model(task.classifier_path)
    labels = read_labels(task.assignment_path, task.file.key)
    scores = np.full(labels.size, np.nan, np.float32)
    n_records = 0
    for b in document_batches(task.file.url, task.text_field, task.max_doc_bytes):
        n_records = b.n_records
        if b.texts:
            idx = np.array(b.records)
            if idx[-1] >= labels.size or (labels[idx] < 0).any():
                raise LayoutError(f"{task.file.url}: holds documents the domain assignment did not label; the file "
                                  "changed since it was assigned")
            scores[idx] = model.score(b.texts)
    if n_records != labels.size:
        raise LayoutError(f"{task.file.url}: {n_records} records, the domain assignment labelled {labels.size}; "
                          "the file changed since it was assigned")
    ok = labels >= 0
    key = labels[ok].astype(np.int64) * N_BINS + score_bins(scores[ok])
    cells, counts = np.unique(key, return_counts=True)
    paths = score_paths(task.work, task.file.key)
    fs, p = fsspec.core.url_to_fs(paths["scores"])
    fs.makedirs(p.rsplit("/", 1)[0], exist_ok=True)
    with fsspec.open(paths["scores"], "wb") as f:
        np.save(f, scores)
    with fsspec.open(paths["hist"], "wb") as f:
        np.savez(f, cells=cells, counts=counts)
    return {"documents": int(ok.sum())}


# --------------------------------------------------------------------------------------------------
# Phase 3: the layout


@dataclass(frozen=True)
class WriteTask:
    file: InputFile
    work: str
    out: str
    assignment_path: str
    names: tuple[str, ...]
    cuts: tuple[tuple[int, ...], ...]
    """Per domain (one row for all with global bucketing), the cut bins."""
    text_field: str
    tokenizer: str | None
    output_format: str
    samples: int
    sample_chars: int
    marker_fp: str


def iter_raw_records(url: str) -> Iterator[bytes]:
    """Every record of a file as one JSON line, numbered as the readers number records: a jsonl record's
    bytes as they are, a parquet row encoded as JSON."""
    if ".parquet" not in url.rsplit("/", 1)[-1]:
        yield from iter_record_lines(url)
        return
    import pyarrow as pa  # pyarrow: the data extra (slow to import), only for parquet
    import pyarrow.parquet as pq  # (the same)

    try:
        with fsspec.open(url, "rb", compression="infer") as f:
            table = pq.read_table(f)
    except (OSError, pa.ArrowException) as e:
        raise CorruptInputError(url, e) from e
    for batch in table.to_batches(max_chunksize=4096):
        for row in batch.to_pylist():
            yield json.dumps(row, ensure_ascii=False, default=str).encode("utf-8")


def output_stem(key: str) -> str:
    """An input file's key without its document extension (its outputs are ``{stem}.{format}``)."""
    for ext in (".jsonl", ".ndjson", ".parquet"):
        if ext in key:
            return key[: key.rindex(ext)]
    return key


def write_file(task: WriteTask) -> dict:
    """Phase 3 for one file: each document appended to its ``{domain}/{bucket}`` output."""
    return file_task(task.file, f"{task.work}/written/{task.file.key}.json", task.marker_fp,
                     lambda: _write_file(task))


def _write_file(task: WriteTask) -> dict:
    labels = read_labels(task.assignment_path, task.file.key)
    with fsspec.open(score_paths(task.work, task.file.key)["scores"], "rb") as f:
        scores = np.load(f)
    ok = labels >= 0
    bins = score_bins(np.where(ok, scores, 0.0))
    cuts = np.array(task.cuts, np.int32)
    row = labels.astype(np.int64) if len(cuts) > 1 else np.zeros(labels.size, np.int64)
    buckets = np.full(labels.size, -1, np.int64)
    for r in np.unique(row[ok]):
        sel = ok & (row == r)
        buckets[sel] = bucket_of(bins[sel], cuts[r])
    tok = None
    if task.tokenizer:
        from marin.data.tokenizer import load_tokenizer  # tokenizers: the data extra, only when counting tokens

        tok = load_tokenizer(task.tokenizer)
    outputs: dict[str, OutputFile] = {}
    counts: dict[str, Counter] = {}
    samples: dict[str, list[dict]] = {}
    pending: list[tuple[str, str]] = []  # (source, text) awaiting token counts

    def count_tokens() -> None:
        if tok is not None and pending:
            for (src, _), ids in zip(pending, tok.encode_batch([t for _, t in pending])):
                counts[src]["tokens"] += len(ids)
        pending.clear()

    stem = output_stem(task.file.key)
    try:
        for i, line in enumerate(iter_raw_records(task.file.url)):
            if i >= labels.size or not ok[i]:
                continue
            d, bkt = task.names[labels[i]], QUALITY_BUCKETS[int(buckets[i])]
            src = source_name(d, bkt)
            if src not in outputs:
                outputs[src] = OutputFile(f"{task.out}/{src}/{stem}.{task.output_format}")
                counts[src] = Counter()
            outputs[src].write(line + b"\n")
            c = counts[src]
            rec = json.loads(line)
            text = rec[task.text_field]  # a document (the assignment labelled it): its text is there
            c["documents"] += 1
            c["bytes"] += len(text.encode("utf-8"))
            if tok is not None:
                pending.append((src, text))
                if len(pending) >= 1024:
                    count_tokens()
            if len(samples.setdefault(d, [])) < task.samples:
                samples[d].append({"id": str(rec.get("id", f"{task.file.source}/{task.file.rel}#{i}")),
                                   "bucket": bkt, "score": round(float(scores[i]), 4),
                                   "text": text[: task.sample_chars]})
        count_tokens()
    finally:
        for o in outputs.values():
            o.close()
    return {"sources": {s: {"documents": c["documents"], "bytes": c["bytes"], "tokens": c["tokens"]}
                        for s, c in sorted(counts.items())}, "samples": samples}


# --------------------------------------------------------------------------------------------------
# The step


def build_k40_layout(config: K40BuildConfig) -> None:
    """Executor step: the K40 layout and its ``k40_manifest.json`` (see the module docstring)."""
    config.validate()
    t0 = time.monotonic()
    inputs = config.input
    out = config.output_path.rstrip("/")
    work = f"{out}/{WORK_DIR}"
    assignment = read_assignment(config.assignment_path)
    fit = load_fit(assignment["fit_path"])
    model = load_quality_model(config.classifier_path)
    files = STEP.plan(config.input_path, out, inputs)
    skip = check_assignment(assignment, files, inputs, config.input_path, config.assignment_path)
    files_in = [f for f in files if f.key not in skip]
    names = tuple(fit.names)

    # phase 1: scores and histograms
    tasks = [ScoreTask(f, work, config.assignment_path, config.classifier_path, inputs.text_field,
                       inputs.max_doc_bytes, fingerprint([model.classifier_id, assignment["fit_id"], inputs.text_field,
                                                          inputs.max_doc_bytes, f.url, f.size, f.key]))
             for f in files_in]
    results = run_tasks(score_file, tasks, "k40 layout: score", inputs, sizes=[f.size for f in files_in])
    STEP.check_failures(results, out, "fail", 0.0, "score")

    # phase 2: the cuts
    hist = np.zeros((fit.k, N_BINS), np.int64)
    for t in tasks:
        with fsspec.open(score_paths(work, t.file.key)["hist"], "rb") as f:
            z = np.load(f)
            np.add.at(hist.reshape(-1), z["cells"], z["counts"])
    rows = hist if config.bucketing == "per_domain" else hist.sum(axis=0, keepdims=True)
    cuts = np.stack([quantile_cuts(r) for r in rows])

    # phase 3: the layout
    wtasks = [WriteTask(f, work, out, config.assignment_path, names, tuple(map(tuple, cuts.tolist())),
                        inputs.text_field, config.tokenizer, config.output_format, config.samples_per_domain,
                        config.sample_chars, fingerprint([t.marker_fp, cuts.tolist(), config.tokenizer,
                                                          config.output_format, config.samples_per_domain,
                                                          config.sample_chars]))
              for f, t in zip(files_in, tasks)]
    written = run_tasks(write_file, wtasks, "k40 layout: write", inputs, sizes=[f.size for f in files_in])
    STEP.check_failures(written, out, "fail", 0.0, "write")

    # the manifest
    counts: dict[str, Counter] = {}
    samples: dict[str, list[dict]] = {}
    n_files: Counter = Counter()
    for r in written:
        for src, c in r["sources"].items():
            counts.setdefault(src, Counter()).update(c)
            n_files[src] += 1
        for d, s in r["samples"].items():
            samples.setdefault(d, []).extend(s[: max(0, config.samples_per_domain - len(samples.get(d, [])))])
    measure = "tokens" if config.tokenizer else "bytes"
    per_domain = {d: sum(counts.get(source_name(d, b), Counter())[measure] for b in QUALITY_BUCKETS) for d in names}
    total = max(sum(per_domain.values()), 1)
    domains = [K40Domain(d, fit.manifest["domains"][i]["title"], per_domain[d] / total, False)
               for i, d in enumerate(names)]
    overview = {}
    for i, d in enumerate(names):
        h = hist[i]
        cum = np.cumsum(h)
        q = {f"p{p}": bin_logit(int(np.searchsorted(cum, cum[-1] * p / 100))) if cum[-1] else None
             for p in (10, 50, 90)}
        overview[d] = {
            "title": fit.manifest["domains"][i]["title"], "top_terms": fit.manifest["domains"][i]["top_terms"],
            "share": round(per_domain[d] / total, 6),  # of tokens, or of bytes without a tokenizer (share_measure)
            "documents": sum(counts.get(source_name(d, b), Counter())["documents"] for b in QUALITY_BUCKETS),
            "buckets": {b: counts.get(source_name(d, b), Counter())["documents"] for b in QUALITY_BUCKETS},
            "score_quantiles": q, "samples": samples.get(d, []),
        }
    cut_rows = {("all" if config.bucketing == "global" else names[i]): [bin_logit(c) for c in row]
                for i, row in enumerate(cuts.tolist())}
    sources = {s: {**{k: int(v) for k, v in c.items()}, "files": n_files[s]} for s, c in counts.items()}
    if not config.tokenizer:
        for s in sources.values():
            s.pop("tokens", None)
    manifest = make_k40_manifest(
        sources, domains,
        kind="k40_layout",
        input_path=config.input_path,
        built_from={"assignment": config.assignment_path, "fit": {"path": fit.path, "fit_id": assignment["fit_id"],
                                                                  "k": fit.k},
                    "classifier": {"path": config.classifier_path, "classifier_id": model.classifier_id},
                    "tokenizer": config.tokenizer},
        share_measure=measure,
        bucketing={"mode": config.bucketing, "cuts_logit": cut_rows, "bins_per_logit": BINS_PER_LOGIT},
        totals={"documents": sum(c["documents"] for c in counts.values()),
                "bytes": sum(c["bytes"] for c in counts.values()),
                **({"tokens": sum(c["tokens"] for c in counts.values())} if config.tokenizer else {}),
                "skipped_files": len(skip)},
        overview=overview,
        skipped_files=sorted(f.url for f in files if f.key in skip),
        seconds=round(time.monotonic() - t0, 3),
    )
    STEP.finish(out, manifest, config.keep_work)
    logger.info("k40 layout %s: %d documents in %d sources (%d domains x %d buckets)", out,
                manifest["totals"]["documents"], len(sources), fit.k, len(QUALITY_BUCKETS))
