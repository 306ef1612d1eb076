"""The tokenize step: documents (jsonl / parquet on any fsspec path) -> a token store (see store.py).

Work is one Ray task per input file; a file becomes one or more shards of at most ``shard_max_tokens``
(plus one batch). Each shard records which input records it covers (``doc_start``/``doc_end``), and
its ``.json`` is written after its data, so:

* a rerun skips every finished shard and resumes a half-done file after its last finished shard;
* a shard whose data was written but whose ``.json`` was not (killed mid-write) does not count and is
  simply rewritten.

Bad documents are counted per reason and never fatal. A corrupt file fails only its own task; the
step finishes every other file, then applies its ``on_corrupt`` policy: with ``"skip"`` (the
default) corrupt files are left out of the store, listed in the manifest's ``skipped_files`` with
the reason and counted in its totals, as long as at most ``max_corrupt_fraction`` of the files are
corrupt. Otherwise (``"fail"``, too many corrupt files, or any other error) it writes
``tokenize_failures.json`` and raises :class:`TokenizeError` naming each failed file, so the
executor marks the step FAILED and a rerun redoes only what is missing. ``manifest.json`` is
written last, only when the step succeeds (and a stale ``tokenize_failures.json`` is then removed).
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
from tqdm.auto import tqdm

from marin.data.readers import (
    DAMAGED_SKIPS,
    DEFAULT_MAX_CORRUPT_FRACTION,
    DEFAULT_ON_CORRUPT,
    CorruptInputError,
    corrupt_policy_violation,
    damaged_documents_violation,
    iter_documents,
    list_document_files,
    validate_corrupt_policy,
)
from marin.data.store import MANIFEST, STORE_FORMAT, source_dir, write_shard
from marin.data.tokenizer import DEFAULT_EOS, load_tokenizer
from marin.execution.versioning import input_field, live

logger = logging.getLogger(__name__)


class TokenizeError(RuntimeError):
    """Some input files could not be tokenized; the message lists each file and why."""


@dataclass(frozen=True)
class TokenizeConfig:
    """Tokenize the document files under ``input_path`` into a token store at ``output_path``.

    sources: source name -> location relative to ``input_path`` (a directory, a file, or a glob).
        None discovers sources: every directory holding document files is one source, named by its
        path relative to ``input_path`` (so a K40 root yields ``council/q1`` ...); files directly
        in ``input_path`` form the source ``default``.
    """

    input_path: str = input_field()
    tokenizer: str = input_field()
    output_path: str = input_field()
    sources: dict[str, str] | None = None
    text_field: str = "text"
    max_doc_bytes: int = 8_000_000
    shard_max_tokens: int = 64 * 1024 * 1024
    eos_token: str = DEFAULT_EOS
    on_corrupt: str = DEFAULT_ON_CORRUPT
    """"skip": leave corrupt files out (listed in the manifest) while at most ``max_corrupt_fraction``
    of the files are corrupt; "fail": any corrupt file fails the step."""
    max_corrupt_fraction: float = DEFAULT_MAX_CORRUPT_FRACTION
    batch_docs: int = 512
    num_cpus_per_task: float = live("CPUs per Ray task: how the work is spread, the store is byte-identical",
                                    default=1.0)
    show_progress: bool = live("a progress bar on the terminal", default=True)
    use_ray: bool = live("Ray tasks or this process: the store is byte-identical either way", default=True)
    """Fan out as Ray tasks when Ray is initialized (always, inside an executor step). False runs
    every file in this process (small jobs, tests); the output is byte-identical either way."""
    allow_empty: bool = live("whether a store (or a source of it) with no document may succeed, not what the "
                             "step writes", default=False)
    """A store, or a source of it, with no document fails the step (a wrong path or text field, a
    corpus of garbage) unless this is True."""


@dataclass(frozen=True)
class FileTask:
    """Everything one worker needs to tokenize one input file."""

    source: str
    input_file: str
    file_key: str
    output_path: str
    tokenizer: str
    eos_token: str
    text_field: str
    max_doc_bytes: int
    shard_max_tokens: int
    batch_docs: int


# --------------------------------------------------------------------------------------------------
# Planning


def _file_key(rel: str) -> str:
    """A shard-name-safe key for an input file (unique within its source)."""
    return rel.replace("/", "__")


def _relative_to(f: str, base: str) -> str:
    """``f``'s path below ``base``, both compared as fsspec sees them (a relative local ``base`` matches
    the absolute paths a listing returns); the file's name when ``f`` is not below ``base``."""
    fs, b = fsspec.core.url_to_fs(base)
    p, b = fs._strip_protocol(f), b.rstrip("/")
    return p[len(b) + 1:] if p.startswith(b + "/") else p.rsplit("/", 1)[-1]


def split_glob(path: str) -> tuple[str, str]:
    """``(input path, source location)`` of a file, directory or glob of documents, as
    :class:`TokenizeConfig` takes them: a path with a glob splits before its first part holding one
    (``gs://b/web/*/part-*.jsonl`` -> ``("gs://b/web", "*/part-*.jsonl")``, so file keys stay
    relative to the literal prefix); a file or a directory is the input path itself, location ``""``."""
    parts = path.rstrip("/").split("/")
    glob_at = next((i for i, part in enumerate(parts) if any(c in part for c in "*?[")), None)
    if glob_at is None:
        return path, ""
    return "/".join(parts[:glob_at]), "/".join(parts[glob_at:])


def discover_sources(input_path: str, sources: Mapping[str, str] | None = None) -> dict[str, list[tuple[str, str]]]:
    """Source name -> [(file url, file path relative to the source location)] in a stable order."""
    root = input_path.rstrip("/")
    out: dict[str, list[tuple[str, str]]] = {}
    if sources is None:
        files = list_document_files(root)
        if not files:
            raise TokenizeError(f"no document files (*.jsonl, *.ndjson, *.parquet, optionally .gz/.zst) under {root}")
        for f in files:
            d, _, name = _relative_to(f, root).rpartition("/")
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
            raise TokenizeError(f"source {name!r}: no document files at {where}")
        # file keys are paths relative to the pattern's literal prefix, so they stay unique
        base = split_glob(where)[0]
        out[name] = [(f, _relative_to(f, base)) for f in files]
    for name, files in out.items():  # shard names derive from these keys: two files must never share one
        keys = [_file_key(rel) for _, rel in files]
        if len(set(keys)) != len(keys):
            dup = sorted({k for k in keys if keys.count(k) > 1})
            raise TokenizeError(f"source {name!r}: several input files map to the shard key(s) {dup[:3]}; "
                                "give each file a distinct path below the source's location")
    return out


# --------------------------------------------------------------------------------------------------
# Worker


def _existing_shards(task: FileTask, tokenizer_identity: str, input_size: int | None) -> list[dict]:
    """Finished shards of this file, in part order, stopping at the first gap.

    Shards of an input file that has since changed size are ignored (the file is redone); shards
    written with another tokenizer are an error, never silently mixed."""
    fs, d = fsspec.core.url_to_fs(source_dir(task.output_path, task.source))
    try:
        fs.invalidate_cache(d)  # object-store listings are cached per process; workers are long-lived
        names = {p.rsplit("/", 1)[-1] for p in fs.ls(d, detail=False)}
    except FileNotFoundError:
        return []
    metas = []
    for part in itertools.count():
        name = f"{task.file_key}-{part:05d}.json"
        if name not in names:
            break
        try:
            with fs.open(f"{d}/{name}", "r") as f:
                meta = json.load(f)
        except ValueError:
            break  # an unreadable marker means an unfinished shard: redo from here
        if meta.get("input_file") != task.input_file or meta.get("input_size") != input_size:
            break  # stale output of another input layout, or the file changed: redo from here
        if meta.get("tokenizer") != tokenizer_identity:
            raise TokenizeError(
                f"{task.output_path} already holds shards of {task.input_file} written with tokenizer "
                f"{str(meta.get('tokenizer'))[:16]}, not {tokenizer_identity[:16]}; use a fresh output path"
            )
        metas.append(meta)
        if meta.get("last"):
            break
    return metas


def _pack(ids_lists: list[list[int]], eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate token lists, each followed by EOS; return (tokens, per-document lengths)."""
    lens = np.fromiter((len(x) + 1 for x in ids_lists), dtype=np.int64, count=len(ids_lists))
    flat = np.fromiter(itertools.chain.from_iterable(ids_lists), dtype=np.uint32, count=int(lens.sum()) - len(lens))
    out = np.empty(int(lens.sum()), dtype=np.uint32)
    ends = np.cumsum(lens) - 1
    mask = np.ones(out.size, dtype=bool)
    mask[ends] = False
    out[mask] = flat
    out[ends] = eos_id
    return out, lens


def tokenize_file(task: FileTask, stop_after_shards: int | None = None) -> dict:
    """Tokenize one file into shards ``{file_key}-{part}``; resume after its last finished shard.

    ``stop_after_shards`` stops (as a kill would) after writing that many new shards; tests use it.
    Returns {"source", "input_file", "shards": [meta...], "error": str | None, "new_tokens": int}.
    """
    result = {"source": task.source, "input_file": task.input_file, "shards": [], "error": None, "corrupt": False,
              "new_tokens": 0}
    try:
        tok = load_tokenizer(task.tokenizer, task.eos_token)
        fs, fpath = fsspec.core.url_to_fs(task.input_file)
        input_size = int(fs.size(fpath))
        done = _existing_shards(task, tok.identity, input_size)
        result["shards"] = list(done)
        if done and done[-1].get("last"):
            return result
        resume_at = done[-1]["doc_end"] if done else 0
        part = len(done)
        written = 0

        buf_tokens: list[np.ndarray] = []
        buf_lens: list[np.ndarray] = []
        n_tokens = 0
        stats = {"bytes": 0, "skipped": Counter(), "skipped_bytes": 0}
        shard_start = resume_at
        pending_texts: list[str] = []
        pending_bytes = 0
        next_index = resume_at

        def encode_pending() -> None:
            nonlocal n_tokens, pending_bytes
            if pending_texts:
                toks, lens = _pack(tok.encode_batch(pending_texts), tok.eos_id)
                buf_tokens.append(toks)
                buf_lens.append(lens)
                n_tokens += toks.size
                stats["bytes"] += pending_bytes
                pending_texts.clear()
                pending_bytes = 0

        def flush(doc_end: int, last: bool) -> None:
            nonlocal buf_tokens, buf_lens, n_tokens, stats, shard_start, part, written
            tokens = np.concatenate(buf_tokens) if buf_tokens else np.zeros(0, np.uint32)
            lens = np.concatenate(buf_lens) if buf_lens else np.zeros(0, np.int64)
            offsets = np.zeros(lens.size + 1, dtype=np.uint64)
            np.cumsum(lens, out=offsets[1:])
            meta = {
                "source": task.source, "input_file": task.input_file, "part": part,
                "doc_start": shard_start, "doc_end": doc_end, "bytes": stats["bytes"],
                "skipped": dict(stats["skipped"]), "skipped_bytes": stats["skipped_bytes"],
                "last": last, "tokenizer": tok.identity, "input_size": input_size,
            }
            meta = write_shard(task.output_path, task.source, f"{task.file_key}-{part:05d}", tokens, offsets, meta)
            result["shards"].append(meta)
            result["new_tokens"] += int(tokens.size)
            part += 1
            written += 1
            buf_tokens, buf_lens, n_tokens = [], [], 0
            stats = {"bytes": 0, "skipped": Counter(), "skipped_bytes": 0}
            shard_start = doc_end

        for rec in iter_documents(task.input_file, task.text_field, task.max_doc_bytes):
            if rec.index < resume_at:
                continue
            next_index = rec.index + 1
            if rec.skip is not None:
                stats["skipped"][rec.skip] += 1
                stats["skipped_bytes"] += rec.nbytes
                continue
            pending_texts.append(rec.text)
            pending_bytes += rec.nbytes
            if len(pending_texts) >= task.batch_docs:
                encode_pending()
                if n_tokens >= task.shard_max_tokens:
                    flush(next_index, last=False)
                    if stop_after_shards is not None and written >= stop_after_shards:
                        return result
        encode_pending()
        flush(max(next_index, shard_start), last=True)
    except Exception as e:  # noqa: BLE001 - reported per file, raised by the step with every file named
        result["error"] = str(e) if isinstance(e, CorruptInputError) else f"{type(e).__name__}: {e}"
        result["corrupt"] = isinstance(e, CorruptInputError)
    return result


# --------------------------------------------------------------------------------------------------
# Step


def build_manifest(config: TokenizeConfig, results: list[dict], tok) -> dict:
    """Aggregate per-shard stats into the store manifest (per source and in total)."""
    sources: dict[str, dict] = {}
    skipped_files = [{"source": r["source"], "input_file": r["input_file"], "reason": r["error"]}
                     for r in results if r["error"]]
    for r in results:
        if r["error"]:  # a corrupt file skipped by the policy: none of its shards are in the store
            continue
        e = sources.setdefault(r["source"], {"documents": 0, "tokens": 0, "bytes": 0, "skipped": Counter(),
                                             "skipped_bytes": 0, "files": 0, "shards": []})
        e["files"] += 1
        for sh in r["shards"]:
            e["documents"] += sh["documents"]
            e["tokens"] += sh["tokens"]
            e["bytes"] += sh["bytes"]
            e["skipped"].update(sh["skipped"])
            e["skipped_bytes"] += sh["skipped_bytes"]
            e["shards"].append({k: sh[k] for k in ("id", "input_file", "part", "documents", "tokens", "bytes",
                                                  "skipped", "doc_start", "doc_end")})
    for e in sources.values():
        e["skipped"] = dict(sorted(e["skipped"].items()))
    totals = {
        k: sum(e[k] for e in sources.values()) for k in ("documents", "tokens", "bytes", "skipped_bytes", "files")
    }
    totals["skipped"] = dict(sum((Counter(e["skipped"]) for e in sources.values()), Counter()))
    totals["skipped_files"] = len(skipped_files)
    return {
        "format": STORE_FORMAT,
        "tokenizer": {"identity": tok.identity, "path": tok.path, "vocab_size": tok.vocab_size,
                      "eos_id": tok.eos_id, "eos_token": tok.eos_token},
        "dtype": "uint32",
        "input_path": config.input_path,
        "text_field": config.text_field,
        "max_doc_bytes": config.max_doc_bytes,
        "on_corrupt": config.on_corrupt,
        "max_corrupt_fraction": config.max_corrupt_fraction,
        "totals": totals,
        "skipped_files": skipped_files,
        "sources": dict(sorted(sources.items())),
    }


def _run_tasks(tasks: list[FileTask], config: TokenizeConfig) -> list[dict]:
    """Run file tasks as Ray tasks when Ray is up (the executor's case), otherwise in this process."""
    total_files = len(tasks)
    bar = tqdm(total=total_files, unit="file", desc="tokenize", disable=not config.show_progress, mininterval=2.0)
    t0 = time.monotonic()
    results: list[dict] = []
    tokens = 0

    def done(r: dict) -> None:
        nonlocal tokens
        results.append(r)
        tokens += r["new_tokens"]
        bar.update(1)
        bar.set_postfix(tokens=tokens, tok_per_s=f"{tokens / max(time.monotonic() - t0, 1e-9):.3g}",
                        failed=sum(1 for x in results if x["error"]), refresh=False)

    try:
        import ray  # Ray: only when the executor runs this step; declaring it must not start Ray
    except ImportError:  # pragma: no cover
        ray = None
    if config.use_ray and ray is not None and ray.is_initialized():
        remote = ray.remote(tokenize_file).options(num_cpus=config.num_cpus_per_task, max_retries=0)
        pending = [remote.remote(t) for t in tasks]
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                done(ray.get(ref))
    else:
        for t in tasks:
            done(tokenize_file(t))
    bar.close()
    logger.info("tokenized %d files: %d new tokens in %.1fs", total_files, tokens, time.monotonic() - t0)
    return results


def empty_or_damaged(manifest: dict[str, Any], config: TokenizeConfig) -> str | None:
    """Why a finished store must not count as a success: no documents at all or in some source
    (unless ``allow_empty``), or more damaged documents than the corrupt-input policy allows."""
    totals = manifest["totals"]
    skipped = totals.get("skipped") or {}
    where = f"under {config.input_path} (text field {config.text_field!r})"
    if not config.allow_empty:
        if totals["documents"] == 0:
            reasons = ", ".join(f"{n} {k}" for k, n in sorted(skipped.items())) or "no records at all"
            return (f"no documents to tokenize {where}: {totals.get('files', 0)} file(s), skipped: {reasons}; check "
                    "the path and text_field, or pass allow_empty=True (default_tokenize, TokenizeConfig) if an empty "
                    "store is what you want")
        empty = sorted(name for name, src in manifest["sources"].items() if src["documents"] == 0)
        if empty:
            return (f"{len(empty)} source(s) {where} have no documents: {', '.join(empty)}; check them, drop them "
                    "from sources, or pass allow_empty=True (default_tokenize, TokenizeConfig)")
    damaged = sum(skipped.get(k, 0) for k in DAMAGED_SKIPS)
    records = totals["documents"] + sum(skipped.values())
    why = damaged_documents_violation(damaged, records, config.max_corrupt_fraction)
    if why:
        return f"{why} {where}; fix the input or raise max_corrupt_fraction"
    return None


def tokenize(config: TokenizeConfig) -> None:
    """Executor step: write the token store at ``config.output_path`` (see module docstring)."""
    validate_corrupt_policy(config.on_corrupt, config.max_corrupt_fraction)
    tok = load_tokenizer(config.tokenizer, config.eos_token)
    plan = discover_sources(config.input_path, config.sources)
    tasks = [
        FileTask(src, url, _file_key(rel), config.output_path.rstrip("/"), config.tokenizer, config.eos_token,
                 config.text_field, config.max_doc_bytes, config.shard_max_tokens, config.batch_docs)
        for src, files in sorted(plan.items()) for url, rel in files
    ]
    order = {(t.source, t.input_file): i for i, t in enumerate(tasks)}
    results = sorted(_run_tasks(tasks, config), key=lambda r: order[(r["source"], r["input_file"])])
    out = config.output_path.rstrip("/")
    failed = [r for r in results if r["error"]]
    corrupt = [r for r in failed if r["corrupt"]]
    why = corrupt_policy_violation(len(corrupt), len(results), config.on_corrupt, config.max_corrupt_fraction)
    if len(corrupt) < len(failed) or why:
        with fsspec.open(f"{out}/tokenize_failures.json", "w") as f:
            json.dump([{"input_file": r["input_file"], "source": r["source"], "error": r["error"]} for r in failed],
                      f, indent=1)
        lines = "\n".join(f"  {r['error']}" if r["input_file"] in r["error"] else f"  {r['input_file']}: {r['error']}"
                          for r in failed)
        policy = f"; {len(corrupt)} corrupt: {why}" if why else ""
        raise TokenizeError(
            f"{len(failed)} of {len(results)} input files failed to tokenize{policy} (finished shards are kept; "
            f"a rerun redoes only the failed files):\n{lines}"
        )
    manifest = build_manifest(config, results, tok)
    problem = empty_or_damaged(manifest, config)
    if problem:
        raise TokenizeError(problem + " (the shards are kept; no manifest was written, so nothing reads this store)")
    with fsspec.open(f"{out}/{MANIFEST}", "w") as f:
        json.dump(manifest, f, indent=1)
    fs, root = fsspec.core.url_to_fs(out)
    if fs.exists(f"{root}/tokenize_failures.json"):  # left by an earlier, failed attempt: no longer true
        fs.rm_file(f"{root}/tokenize_failures.json")
    t = manifest["totals"]
    for r in corrupt:
        logger.warning("skipped corrupt file (on_corrupt='skip'): %s", r["error"])
    logger.info("token store %s: %d sources, %d documents, %d tokens, skipped %s, %d corrupt files skipped",
                out, len(manifest["sources"]), t["documents"], t["tokens"], t["skipped"] or "none",
                t["skipped_files"])
