"""The tokenize step: documents (jsonl / parquet on any fsspec path) -> a token store (see store.py).

Work is one task per input file, run by the frame of every corpus step (:mod:`marin.data.corpus_steps`:
planning, the Ray fan-out, the corrupt-input policy, the checks); a file becomes one or more shards of
at most ``shard_max_tokens`` (plus one batch). Each shard records which input records it covers
(``doc_start``/``doc_end``), and its ``.json`` is written after its data, so:

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
from dataclasses import dataclass

import fsspec
import numpy as np

from marin.data.corpus_steps import (
    CorpusInput,
    CorpusStep,
    CorpusStepError,
    file_key,
    input_group,
    run_tasks,
    task_error,
)
from marin.data.readers import iter_documents
from marin.data.store import MANIFEST, STORE_FORMAT, source_dir, write_shard
from marin.data.tokenizer import DEFAULT_EOS, load_tokenizer
from marin.execution.versioning import input_field

logger = logging.getLogger(__name__)


class TokenizeError(CorpusStepError):
    """Some input files could not be tokenized; the message lists each file and why."""


STEP = CorpusStep("tokenize", TokenizeError, MANIFEST, "tokenize_failures.json")


@dataclass(frozen=True)
class TokenizeConfig:
    """Tokenize the document files under ``input_path`` (read as ``input`` says:
    :class:`~marin.data.corpus_steps.CorpusInput`) into a token store at ``output_path``."""

    input_path: str = input_field()
    tokenizer: str = input_field()
    output_path: str = input_field()
    input: CorpusInput = input_group()
    shard_max_tokens: int = 64 * 1024 * 1024
    eos_token: str = DEFAULT_EOS
    batch_docs: int = 512


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
    Returns {"source", "url", "shards": [meta...], "error": str | None, "corrupt": bool, "new_tokens": int}.
    """
    result = {"source": task.source, "url": task.input_file, "shards": [], "error": None, "corrupt": False,
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
        result["error"], result["corrupt"] = task_error(e)
    return result


# --------------------------------------------------------------------------------------------------
# Step


def build_manifest(config: TokenizeConfig, results: list[dict], tok) -> dict:
    """Aggregate per-shard stats into the store manifest (per source and in total)."""
    sources: dict[str, dict] = {}
    skipped_files = [{"source": r["source"], "input_file": r["url"], "reason": r["error"]}
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
        "text_field": config.input.text_field,
        "max_doc_bytes": config.input.max_doc_bytes,
        "on_corrupt": config.input.on_corrupt,
        "max_corrupt_fraction": config.input.max_corrupt_fraction,
        "totals": totals,
        "skipped_files": skipped_files,
        "sources": dict(sorted(sources.items())),
    }


def tokenize(config: TokenizeConfig) -> None:
    """Executor step: write the token store at ``config.output_path`` (see module docstring)."""
    inputs = config.input
    inputs.validate()
    tok = load_tokenizer(config.tokenizer, config.eos_token)
    out = config.output_path.rstrip("/")
    files = STEP.plan(config.input_path, out, inputs)
    tasks = [FileTask(f.source, f.url, file_key(f.rel), out, config.tokenizer, config.eos_token, inputs.text_field,
                      inputs.max_doc_bytes, config.shard_max_tokens, config.batch_docs) for f in files]
    t0 = time.monotonic()
    results = run_tasks(tokenize_file, tasks, "tokenize", inputs, sizes=[f.size for f in files], tally="new_tokens")
    logger.info("tokenized %d files: %d new tokens in %.1fs", len(tasks), sum(r["new_tokens"] for r in results),
                time.monotonic() - t0)
    corrupt = STEP.check_failures(results, out, inputs.on_corrupt, inputs.max_corrupt_fraction)
    manifest = build_manifest(config, results, tok)
    t = manifest["totals"]
    STEP.check_documents(t["documents"], t["skipped"], t["files"], config.input_path, inputs,
                         "the shards are kept; no manifest was written, so nothing reads this store",
                         sorted(name for name, src in manifest["sources"].items() if src["documents"] == 0))
    STEP.finish(out, manifest)
    for r in corrupt:
        logger.warning("skipped corrupt file (on_corrupt='skip'): %s", r["error"])
    logger.info("token store %s: %d sources, %d documents, %d tokens, skipped %s, %d corrupt files skipped",
                out, len(manifest["sources"]), t["documents"], t["tokens"], t["skipped"] or "none",
                t["skipped_files"])
