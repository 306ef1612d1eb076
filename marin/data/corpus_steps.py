"""The frame of every per-file corpus step (tokenize, dedup, decontaminate): what it reads, how its
files are planned, run, restarted and checked, and how its output is finished.

A corpus step reads document files in the layout the tokenize step reads (one directory per source,
``domain/bucket`` for K40; jsonl, .gz, .zst or parquet) and does its work one input file at a time:

* **what it reads** is one :class:`CorpusInput` group embedded in the step's config (sources, text
  field, size limit, corrupt-input policy, and how the work is spread: Ray, CPUs per task, progress);
  its fields are named in the step's hash as the config's own (``text_field``, not
  ``input.text_field``), so grouping them moved no step's hash;
* **planning** (:func:`discover_sources`, :func:`plan_files`): every input file, in a stable order
  (higher quality bucket first, then source name and path), with the output file it becomes;
* **per-file tasks** (:func:`file_task`): a task whose ``.json`` marker was written with the same
  fingerprint is skipped, so a rerun after a kill redoes only what is missing; a failure is returned,
  not raised, so the step sees every failed file;
* **the fan-out** (:func:`run_tasks`): Ray tasks when Ray is up (the executor's case), otherwise this
  process, with small files grouped into one Ray task; the output is byte-identical either way;
* **the checks** (:meth:`CorpusStep.check_failures`, :meth:`CorpusStep.check_documents`): the
  corrupt-input policy over the failed files, and an input with no document (or too many damaged
  ones) refused, each with the step's own error (a subclass of :class:`CorpusStepError`);
* **the output**: kept records copied byte for byte in the input's format (:func:`write_kept_records`),
  counts per source, domain and in total (:func:`summarize`), and the manifest written last, only on
  success (:meth:`CorpusStep.finish`).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
from tqdm.auto import tqdm

from marin.data.k40 import QUALITY_BUCKETS, split_source_name
from marin.data.readers import (
    DAMAGED_SKIPS,
    DEFAULT_MAX_CORRUPT_FRACTION,
    DEFAULT_ON_CORRUPT,
    CorruptInputError,
    corrupt_policy_violation,
    damaged_documents_violation,
    iter_record_lines,
    list_document_files,
    validate_corrupt_policy,
)
from marin.execution.versioning import group, live

WORK_DIR = "_work"


class CorpusStepError(RuntimeError):
    """A corpus step cannot produce its output; the message says why (each failed file named). Each
    step raises its own subclass (``TokenizeError``, ``DedupError``, ``DecontaminationError``)."""


@dataclass(frozen=True)
class CorpusInput:
    """What a corpus step reads, and how its per-file work is spread: a group of the step's config
    (``TokenizeConfig.input``, ``DedupConfig.input``, ``DecontaminateConfig.input``), taken whole by
    the builders (``default_tokenize(..., input=CorpusInput(text_field="body"))``).

    sources: source name -> location below the step's input path (a directory, a file, or a glob).
        None discovers sources: every directory holding document files is one source, named by its
        path relative to the input path (so a K40 root yields ``council/q1`` ...); files directly in
        the input path form the source ``default``.
    """

    sources: dict[str, str] | None = None
    text_field: str = "text"
    """The field of each record that holds the document text."""
    max_doc_bytes: int = 8_000_000
    """Longer documents are skipped (and counted)."""
    on_corrupt: str = DEFAULT_ON_CORRUPT
    """"skip": leave corrupt files out (listed in the manifest) while at most ``max_corrupt_fraction``
    of the files are corrupt; "fail": any corrupt file fails the step."""
    max_corrupt_fraction: float = DEFAULT_MAX_CORRUPT_FRACTION
    allow_empty: bool = live("whether an input (or a source of it) with no document may succeed, not what the "
                             "step writes", default=False)
    """An input with no document fails the step (a wrong path or text field, a corpus of garbage)
    unless this is True."""
    use_ray: bool = live("Ray tasks or this process: the output is byte-identical either way", default=True)
    """Fan out as Ray tasks when Ray is initialized (always, inside an executor step). False runs
    every file in this process (small jobs, tests)."""
    num_cpus_per_task: float = live("CPUs per Ray task: how the work is spread, the output is the same",
                                    default=1.0)
    min_task_bytes: int = live("how files are grouped into Ray tasks; the output is the same", default=64 << 20)
    """Input bytes per Ray task at least: small files share a task (each keeps its own markers)."""
    show_progress: bool = live("a progress bar on the terminal", default=True)

    def validate(self) -> None:
        """Refuse a corrupt-input policy that is not one (ValueError), before any file is read."""
        validate_corrupt_policy(self.on_corrupt, self.max_corrupt_fraction)


def input_group() -> Any:
    """The ``input`` field of a corpus step's config: a :class:`CorpusInput` group (its defaults
    unless given), each field versioned by its own rule and named in the hash as the config's own."""
    return group("what is read and how the work is spread: each field by its own rule, named in the hash as "
                 "this config's own (text_field)", default_factory=CorpusInput)


# --------------------------------------------------------------------------------------------------
# Planning


def file_key(rel: str) -> str:
    """A name-safe key for an input file's path (unique where the paths are)."""
    return rel.replace("/", "__")


def relative_to(f: str, base: str) -> str:
    """``f``'s path below ``base``, both compared as fsspec sees them (a relative local ``base`` matches
    the absolute paths a listing returns); the file's name when ``f`` is not below ``base``."""
    fs, b = fsspec.core.url_to_fs(base)
    p, b = fs._strip_protocol(f), b.rstrip("/")
    return p[len(b) + 1:] if p.startswith(b + "/") else p.rsplit("/", 1)[-1]


def split_glob(path: str) -> tuple[str, str]:
    """``(input path, source location)`` of a file, directory or glob of documents, as
    :class:`CorpusInput` takes them: a path with a glob splits before its first part holding one
    (``gs://b/web/*/part-*.jsonl`` -> ``("gs://b/web", "*/part-*.jsonl")``, so file keys stay
    relative to the literal prefix); a file or a directory is the input path itself, location ``""``."""
    parts = path.rstrip("/").split("/")
    glob_at = next((i for i, part in enumerate(parts) if any(c in part for c in "*?[")), None)
    if glob_at is None:
        return path, ""
    return "/".join(parts[:glob_at]), "/".join(parts[glob_at:])


def discover_sources(input_path: str, sources: Mapping[str, str] | None = None) -> dict[str, list[tuple[str, str]]]:
    """Source name -> [(file url, file path relative to the source location)] in a stable order
    (see :class:`CorpusInput`); raises :class:`CorpusStepError` for a source without files."""
    root = input_path.rstrip("/")
    out: dict[str, list[tuple[str, str]]] = {}
    if sources is None:
        files = list_document_files(root)
        if not files:
            raise CorpusStepError(f"no document files (*.jsonl, *.ndjson, *.parquet, optionally .gz/.zst) under "
                                  f"{root}")
        for f in files:
            d, _, name = relative_to(f, root).rpartition("/")
            out.setdefault(d or "default", []).append((f, name))
        return out
    for name, loc in sources.items():
        where = f"{root}/{loc}" if loc else root
        if any(c in loc for c in "*?["):
            fs, _ = fsspec.core.url_to_fs(where)
            files = sorted(fs.unstrip_protocol(p) if "://" in where else p for p in fs.glob(where))
        else:
            files = list_document_files(where)
        if not files:
            raise CorpusStepError(f"source {name!r}: no document files at {where}")
        # file keys are paths relative to the pattern's literal prefix, so they stay unique
        base = split_glob(where)[0]
        out[name] = [(f, relative_to(f, base)) for f in files]
    for name, files in out.items():  # output names derive from these keys: two files must never share one
        keys = [file_key(rel) for _, rel in files]
        if len(set(keys)) != len(keys):
            dup = sorted({k for k in keys if keys.count(k) > 1})
            raise CorpusStepError(f"source {name!r}: several input files map to the key(s) {dup[:3]}; "
                                  "give each file a distinct path below the source's location")
    return out


def bucket_rank(source: str) -> int:
    """Sort key of a source's quality: 0 for the highest bucket (q5), larger for lower ones."""
    _, bucket = split_source_name(source)
    n = len(QUALITY_BUCKETS)
    return n - 1 - QUALITY_BUCKETS.index(bucket) if bucket in QUALITY_BUCKETS else n


@dataclass(frozen=True)
class InputFile:
    """One input file, in plan order (``index``), and where its output goes."""

    index: int
    source: str
    url: str
    rel: str
    size: int
    key: str
    """Unique in the corpus: ``{source}/{rel}`` as a name (work files and markers are named by it)."""
    output: str


def plan_files(input_path: str, output_path: str, sources: Mapping[str, str] | None) -> list[InputFile]:
    """Every input file, ordered by quality (higher bucket first, then source name and path: the dedup
    step's survivor order), with the output file it becomes: ``{output}/{source}/{path below the source}``."""
    plan = discover_sources(input_path, sources)
    out = output_path.rstrip("/")
    rows = sorted(((bucket_rank(src), src, rel, url) for src, files in plan.items() for url, rel in files))
    fs, _ = fsspec.core.url_to_fs(input_path)
    urls = [url for _, _, _, url in rows]
    sizes = dict(zip(urls, map(int, fs.sizes(urls))))  # concurrent on an object store, from its listing cache
    return [InputFile(i, src, url, rel, sizes[url], file_key(f"{src}/{rel}"), f"{out}/{src}/{rel}")
            for i, (_, src, rel, url) in enumerate(rows)]


# --------------------------------------------------------------------------------------------------
# Work files and markers


def fingerprint(obj: Any) -> str:
    """A short hash of a JSON-able value: what a work marker was made from."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_marker(path: str) -> dict | None:
    """A finished task's ``.json`` marker, or None (missing or unreadable: the task is redone)."""
    try:
        with fsspec.open(path, "r") as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


def write_json(path: str, obj: Any) -> None:
    fs, p = fsspec.core.url_to_fs(path)
    fs.makedirs(p.rsplit("/", 1)[0], exist_ok=True)
    with fsspec.open(path, "w") as f:
        json.dump(obj, f, indent=1)


def task_error(e: BaseException) -> tuple[str, bool]:
    """(message, is the file corrupt) for a failed per-file task."""
    corrupt = isinstance(e, CorruptInputError)
    return (str(e) if corrupt else f"{type(e).__name__}: {e}"), corrupt


def file_task(f: InputFile, marker: str, marker_fp: str, body: Callable[[], dict]) -> dict:
    """The frame of a per-file task: a finished marker made with the same fingerprint is the result
    (the work is skipped); otherwise ``body()`` runs and its result is written as the marker, last. A
    failure is returned, not raised, so the step can apply the corrupt-input policy with every failed
    file named."""
    result = {"index": f.index, "source": f.source, "url": f.url, "error": None, "corrupt": False}
    try:
        done = read_marker(marker)
        if done and done.get("fingerprint") == marker_fp:
            return {**result, **done}
        meta = {"fingerprint": marker_fp, **body()}
        write_json(marker, meta)
        return {**result, **meta}
    except Exception as e:  # noqa: BLE001 - reported per file, raised by the step with every file named
        result["error"], result["corrupt"] = task_error(e)
        return result


# --------------------------------------------------------------------------------------------------
# Kept records


class OutputFile:
    """A binary output stream compressed as its name says (.gz with mtime 0, so reruns write the same
    bytes; .zst at level 3)."""

    def __init__(self, path: str) -> None:
        fs, p = fsspec.core.url_to_fs(path)
        fs.makedirs(p.rsplit("/", 1)[0], exist_ok=True)
        self._raw = fsspec.open(path, "wb").open()
        if path.endswith(".gz"):
            self.stream = gzip.GzipFile(fileobj=self._raw, mode="wb", mtime=0, filename="")
        elif path.endswith(".zst"):
            import zstandard  # zstandard: the data extra, only for .zst files

            self.stream = zstandard.ZstdCompressor(level=3).stream_writer(self._raw, closefd=False)
        else:
            self.stream = self._raw

    def write(self, b: bytes) -> None:
        self.stream.write(b)

    def close(self) -> None:
        if self.stream is not self._raw:
            self.stream.close()
        self._raw.close()


def write_kept_records(src: str, dst: str, drop: Iterable[int], text_field: str,
                       replace: Mapping[int, str] | None = None) -> None:
    """Copy ``src`` to ``dst`` (same format) without the records numbered in ``drop``; records in
    ``replace`` get that text instead of theirs (every other field kept). Raises CorruptInputError."""
    drop = set(int(i) for i in drop)
    replace = dict(replace or {})
    name = src.rsplit("/", 1)[-1]
    if ".parquet" in name:
        import pyarrow as pa  # pyarrow: the data extra (slow to import), only for parquet
        import pyarrow.parquet as pq  # (the same)

        try:
            with fsspec.open(src, "rb", compression="infer") as f:
                table = pq.read_table(f)
        except (OSError, pa.ArrowException) as e:
            raise CorruptInputError(src, e) from e
        if replace:
            col = table.column(text_field).to_pylist()
            for i, t in replace.items():
                col[i] = t
            table = table.set_column(table.schema.get_field_index(text_field), text_field, pa.array(col, pa.string()))
        keep = np.ones(table.num_rows, dtype=bool)
        keep[[i for i in drop if i < table.num_rows]] = False
        out = OutputFile(dst)
        try:
            pq.write_table(table.filter(pa.array(keep)), out.stream, compression="snappy")
        finally:
            out.close()
        return
    out = OutputFile(dst)
    kept: list[bytes] = []
    size = 0
    try:
        for i, line in enumerate(iter_record_lines(src)):
            if i in drop:
                continue
            if i in replace:
                obj = json.loads(line)
                obj[text_field] = replace[i]
                line = json.dumps(obj, ensure_ascii=False).encode("utf-8")
            kept.append(line)
            size += len(line)
            if size >= 1 << 20:  # one write a megabyte, not one a record
                out.write(b"\n".join(kept) + b"\n")
                kept, size = [], 0
        if kept:
            out.write(b"\n".join(kept) + b"\n")
    finally:
        out.close()


# --------------------------------------------------------------------------------------------------
# The fan-out


def run_batch(fn: Callable[[Any], dict], batch: Sequence[Any]) -> list[dict]:
    """``fn`` over a batch of tasks, in order: what one Ray task runs."""
    return [fn(t) for t in batch]


def batches(sizes: Sequence[int], min_bytes: int) -> list[range]:
    """Consecutive task indices grouped until each group holds at least ``min_bytes`` (the last may
    hold less): many small files share a Ray task, so task start-up does not dominate."""
    out, start, acc = [], 0, 0
    for i, n in enumerate(sizes):
        acc += n
        if acc >= min_bytes:
            out.append(range(start, i + 1))
            start, acc = i + 1, 0
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


def run_tasks(fn: Callable[[Any], dict], tasks: Sequence[Any], desc: str, inputs: CorpusInput, *,
              sizes: Sequence[int] | None = None, tally: str | None = None) -> list[dict]:
    """``fn`` over ``tasks`` as Ray tasks when Ray is up and ``inputs.use_ray`` (the executor's case),
    otherwise in this process; results in task order. With ``sizes`` (input bytes per task),
    consecutive tasks are grouped into Ray tasks of at least ``inputs.min_task_bytes``, or of the
    input's share of one task slot of the cluster when that is smaller (a small corpus still uses
    every CPU). ``tally``: a numeric result field the progress bar sums and shows with its rate
    (tokenize: the new tokens)."""
    bar = tqdm(total=len(tasks), unit="task", desc=desc, disable=not inputs.show_progress, mininterval=2.0)
    # Ray is up only if something imported it (the executor does): never import it here, since
    # importing Ray costs seconds and an in-process run does not need it
    ray = sys.modules.get("ray") if inputs.use_ray else None
    results: list[dict] = [None] * len(tasks)  # type: ignore[list-item]
    t0, total, failed = time.monotonic(), 0, 0

    def done(i: int, r: dict) -> None:
        nonlocal total, failed
        results[i] = r
        failed += bool(r.get("error"))
        if tally is not None:
            total += r.get(tally, 0)
            bar.set_postfix({tally: total, "per_s": f"{total / max(time.monotonic() - t0, 1e-9):.3g}",
                             "failed": failed}, refresh=False)
        bar.update(1)

    on_ray = ray is not None and ray.is_initialized()
    groups = [range(i, i + 1) for i in range(len(tasks))]
    if sizes is not None:
        slots = ray.cluster_resources().get("CPU", 1) / inputs.num_cpus_per_task if on_ray else 1
        groups = batches(sizes, min(inputs.min_task_bytes, int(sum(sizes) / max(slots, 1))))
    if on_ray and len(groups) > 1:
        remote = ray.remote(run_batch).options(num_cpus=inputs.num_cpus_per_task, max_retries=0)
        refs = {remote.remote(fn, [tasks[i] for i in g]): g for g in groups}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                for i, r in zip(refs[ref], ray.get(ref)):
                    done(i, r)
    else:
        for i, t in enumerate(tasks):
            done(i, fn(t))
    bar.close()
    return results


# --------------------------------------------------------------------------------------------------
# Counts


def summarize(rows: Sequence[dict], reasons: Sequence[str]) -> dict[str, Any]:
    """Per-source, per-domain and total counts of documents and bytes in and out, removed per reason
    and skipped, from one row per written file."""
    def empty() -> dict[str, Any]:
        return {"files": 0, "documents_in": 0, "bytes_in": 0, "documents_out": 0, "bytes_out": 0,
                "removed": {r: 0 for r in reasons}, "removed_bytes": {r: 0 for r in reasons}, "skipped": Counter()}

    def add(into: dict[str, Any], e: Mapping[str, Any]) -> None:
        into["files"] += e.get("files", 1)
        for k in ("documents_in", "bytes_in", "documents_out", "bytes_out"):
            into[k] += e[k]
        for k in reasons:
            into["removed"][k] += e["removed"].get(k, 0)
            into["removed_bytes"][k] += e["removed_bytes"].get(k, 0)
        into["skipped"].update(e.get("skipped") or {})

    by_source: dict[str, dict[str, Any]] = {}
    for r in rows:  # a row is one file: it counts as one
        add(by_source.setdefault(r["source"], empty()), {**r, "files": 1})
    by_domain: dict[str, dict[str, Any]] = {}
    totals = empty()
    for name, e in sorted(by_source.items()):
        add(by_domain.setdefault(split_source_name(name)[0], empty()), e)
        add(totals, e)
    for e in (*by_source.values(), *by_domain.values(), totals):
        e["skipped"] = dict(sorted(e["skipped"].items()))
    return {"totals": totals, "domains": dict(sorted(by_domain.items())), "sources": dict(sorted(by_source.items()))}


# --------------------------------------------------------------------------------------------------
# The step: checks and the finished output


@dataclass(frozen=True)
class CorpusStep:
    """A corpus step as the frame names it: in progress bars and messages (``name``), its error, the
    manifest it writes last and the failures file it leaves when it fails."""

    name: str
    error: type[CorpusStepError]
    manifest: str
    failures: str

    def plan(self, input_path: str, output_path: str, inputs: CorpusInput) -> list[InputFile]:
        """:func:`plan_files`, its errors raised as this step's."""
        try:
            return plan_files(input_path, output_path, inputs.sources)
        except CorpusStepError as e:
            raise self.error(str(e)) from None

    def check_failures(self, results: Sequence[dict], out: str, on_corrupt: str, max_corrupt_fraction: float,
                       phase: str = "") -> list[dict]:
        """Apply the corrupt-input policy to per-file results (each with ``url``, ``source``, ``error``
        and ``corrupt``): return the corrupt files to skip, or write the failures file and raise this
        step's error naming every failed file (and the ``phase`` of the step, if it has several)."""
        failed = [r for r in results if r.get("error")]
        corrupt = [r for r in failed if r.get("corrupt")]
        why = corrupt_policy_violation(len(corrupt), len(results), on_corrupt, max_corrupt_fraction)
        if len(corrupt) < len(failed) or why:
            write_json(f"{out}/{self.failures}", [{"input_file": r["url"], "source": r["source"],
                                                   "error": r["error"]} for r in failed])
            lines = "\n".join(f"  {r['error']}" if r["url"] in r["error"] else f"  {r['url']}: {r['error']}"
                              for r in failed)
            policy = f"; {len(corrupt)} corrupt: {why}" if why else ""
            step = f"{self.name} {phase}" if phase else self.name
            raise self.error(f"{len(failed)} of {len(results)} input files failed in the {step} step{policy} "
                             f"(finished work is kept; a rerun redoes only what is missing):\n{lines}")
        return corrupt

    def check_documents(self, documents: int, skipped: Mapping[str, int], files: int, input_path: str,
                        inputs: CorpusInput, kept: str, empty_sources: Sequence[str] = ()) -> None:
        """Refuse an input that must not count: no documents at all, or a source in ``empty_sources``
        (unless ``inputs.allow_empty``), or more damaged documents than the corrupt-input policy allows.
        ``kept``: what the failed step leaves behind, said at the end of the message."""
        where = f"under {input_path} (text field {inputs.text_field!r})"
        allow = "CorpusInput(allow_empty=True)"
        damaged = sum(skipped.get(k, 0) for k in DAMAGED_SKIPS)
        why = damaged_documents_violation(damaged, documents + sum(skipped.values()), inputs.max_corrupt_fraction)
        if not inputs.allow_empty and documents == 0:
            reasons = ", ".join(f"{n} {k}" for k, n in sorted(skipped.items())) or "no records at all"
            problem = (f"no documents {where}: {files} file(s), skipped: {reasons}; check the path and text_field, "
                       f"or set {allow} if an empty output is what you want")
        elif not inputs.allow_empty and empty_sources:
            problem = (f"{len(empty_sources)} source(s) {where} have no documents: {', '.join(empty_sources)}; "
                       f"check them, drop them from sources, or set {allow}")
        elif why:
            problem = f"{why} {where}; fix the input or raise max_corrupt_fraction"
        else:
            return
        raise self.error(f"{problem} ({kept})")

    def check_results(self, results: Sequence[dict], out: str, input_path: str, inputs: CorpusInput,
                      kept: str) -> tuple[list[dict], list[dict], Counter, int]:
        """:meth:`check_failures` then :meth:`check_documents` over per-file results that count their
        ``documents`` and ``skipped`` records: returns (the good results, the corrupt files skipped,
        the skipped records by reason, the documents)."""
        corrupt = self.check_failures(results, out, inputs.on_corrupt, inputs.max_corrupt_fraction)
        good = [r for r in results if not r.get("error")]
        skipped = sum((Counter(r["skipped"]) for r in good), Counter())
        documents = sum(r["documents"] for r in good)
        self.check_documents(documents, skipped, len(good), input_path, inputs, kept)
        return good, corrupt, skipped, documents

    def finish(self, out: str, manifest: dict, keep_work: bool = False) -> None:
        """Write the manifest (last: it marks success), then drop a stale failures file and the work files."""
        write_json(f"{out}/{self.manifest}", manifest)
        fs, root = fsspec.core.url_to_fs(out)
        if fs.exists(f"{root}/{self.failures}"):  # left by an earlier, failed attempt: no longer true
            fs.rm_file(f"{root}/{self.failures}")
        if not keep_work and fs.exists(f"{root}/{WORK_DIR}"):
            fs.rm(f"{root}/{WORK_DIR}", recursive=True)
