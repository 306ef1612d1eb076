"""The token store: uint32 token shards with document boundaries, and a manifest.

Layout of one store (the output directory of one tokenize step)::

    {store}/manifest.json                         tokenizer identity, counts per source and per shard
    {store}/sources/{source}/{shard}.tokens       token ids, uint32 little-endian, documents back to back,
                                                  each document ends with the tokenizer's EOS id
    {store}/sources/{source}/{shard}.docs         uint64 little-endian document start offsets into
                                                  .tokens, n_docs + 1 entries (first 0, last = n_tokens)
    {store}/sources/{source}/{shard}.json         the shard's stats; written LAST, so its presence is
                                                  what marks the shard finished (resume relies on it)

``{source}`` is ``domain/bucket`` for K40 data. Within a source, shards are ordered by
(input file, part) and their concatenation is the source's *token stream*; global token and document
indices below refer to that stream. Reading never loads a whole shard: local files are memory-mapped,
remote ones (s3://, gs://) are read with ranged requests; only the small ``.docs`` arrays are cached.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import fsspec
import numpy as np

from marin.data.tokenizer import LoadedTokenizer, load_tokenizer

STORE_FORMAT = "marin-token-store/1"
MANIFEST = "manifest.json"
TOKEN_DTYPE = np.dtype("<u4")
OFFSET_DTYPE = np.dtype("<u8")


class TokenizerMismatchError(ValueError):
    """A store is read with a different tokenizer than the one it was written with."""


class StoreError(ValueError):
    """A store is missing, incomplete, or not a token store."""


def source_dir(store: str, source: str) -> str:
    return f"{store.rstrip('/')}/sources/{source}"


def shard_paths(store: str, source: str, shard_id: str) -> dict[str, str]:
    base = f"{source_dir(store, source)}/{shard_id}"
    return {"tokens": base + ".tokens", "docs": base + ".docs", "meta": base + ".json"}


def write_shard(
    store: str, source: str, shard_id: str, tokens: np.ndarray, doc_offsets: np.ndarray, meta: dict
) -> dict:
    """Write one shard's data files, then its ``.json`` (the finished marker). Returns the meta written."""
    tokens = np.ascontiguousarray(tokens, dtype=TOKEN_DTYPE)
    doc_offsets = np.ascontiguousarray(doc_offsets, dtype=OFFSET_DTYPE)
    if doc_offsets.size == 0 or doc_offsets[0] != 0 or int(doc_offsets[-1]) != tokens.size:
        raise ValueError("doc_offsets must start at 0 and end at len(tokens)")
    paths = shard_paths(store, source, shard_id)
    fs, tok_path = fsspec.core.url_to_fs(paths["tokens"])
    fs.makedirs(tok_path.rsplit("/", 1)[0], exist_ok=True)
    for key, arr in (("tokens", tokens), ("docs", doc_offsets)):
        with fsspec.open(paths[key], "wb") as f:
            f.write(memoryview(arr).cast("B"))
    meta = {**meta, "id": shard_id, "documents": int(doc_offsets.size - 1), "tokens": int(tokens.size)}
    text = json.dumps(meta)
    if _is_local(fs):
        # write-then-rename, so a crash never leaves a half-written marker on local disk
        # (object stores publish an object only when its upload completes)
        tmp = fs._strip_protocol(paths["meta"]) + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, fs._strip_protocol(paths["meta"]))
    else:
        with fsspec.open(paths["meta"], "w") as f:
            f.write(text)
    return meta


def _is_local(fs) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocols


def read_shard_meta(store: str, source: str, shard_id: str) -> dict | None:
    """The finished shard's stats, or None if the shard is absent or unfinished."""
    try:
        with fsspec.open(shard_paths(store, source, shard_id)["meta"], "r") as f:
            return json.load(f)
    except FileNotFoundError:
        return None


_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _expected_identity(expected) -> tuple[str, str]:
    """(identity, description) of what the caller expects: a LoadedTokenizer, identity hex, or a path."""
    if isinstance(expected, LoadedTokenizer):
        return expected.identity, expected.path
    if isinstance(expected, str) and _HEX64.match(expected):
        return expected, "identity given"
    loaded = load_tokenizer(str(expected))
    return loaded.identity, loaded.path


@dataclass(frozen=True)
class ShardInfo:
    id: str
    tokens_path: str
    docs_path: str
    num_tokens: int
    num_documents: int


class SourceReader:
    """Random access into one source's token stream (all its shards, in order)."""

    def __init__(self, store: str, name: str, entry: dict):
        self.store = store
        self.name = name
        self.entry = entry
        shards = []
        for sh in entry["shards"]:
            if sh["tokens"] == 0:
                continue  # all-bad or empty input files leave empty shards; they hold nothing to read
            p = shard_paths(store, name, sh["id"])
            shards.append(ShardInfo(sh["id"], p["tokens"], p["docs"], int(sh["tokens"]), int(sh["documents"])))
        self.shards: tuple[ShardInfo, ...] = tuple(shards)
        self.token_starts = np.zeros(len(shards) + 1, dtype=np.int64)
        self.token_starts[1:] = np.cumsum([s.num_tokens for s in shards], dtype=np.int64)
        self.doc_starts = np.zeros(len(shards) + 1, dtype=np.int64)
        self.doc_starts[1:] = np.cumsum([s.num_documents for s in shards], dtype=np.int64)
        self._fs, _ = fsspec.core.url_to_fs(store)
        self.is_local = _is_local(self._fs)
        self._maps: dict[int, np.ndarray] = {}
        self._offsets: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    @property
    def num_tokens(self) -> int:
        return int(self.token_starts[-1])

    @property
    def num_documents(self) -> int:
        return int(self.doc_starts[-1])

    # -- per-shard access --------------------------------------------------------------------------
    def shard_tokens(self, k: int) -> np.ndarray:
        """The whole shard as an array: a read-only memmap locally (no read happens until sliced)."""
        if not self.is_local:
            raise StoreError("shard_tokens() maps local shards only; use read() for remote stores")
        m = self._maps.get(k)
        if m is None:
            path = self._fs._strip_protocol(self.shards[k].tokens_path)
            # A plain ndarray view of the map: slicing np.memmap objects costs microseconds each.
            m = np.memmap(path, dtype=TOKEN_DTYPE, mode="r", shape=(self.shards[k].num_tokens,)).view(np.ndarray)
            self._maps[k] = m
        return m

    def all_shard_tokens(self) -> list[np.ndarray]:
        """Every shard mapped (mapping is lazy: nothing is read until sliced). Local stores only."""
        return [self.shard_tokens(k) for k in range(len(self.shards))]

    def doc_offsets(self, k: int) -> np.ndarray:
        """Document start offsets of shard ``k`` (n_docs + 1 entries), cached after the first read."""
        arr = self._offsets.get(k)
        if arr is None:
            with self._lock:
                raw = self._fs.cat_file(self.shards[k].docs_path)
                arr = np.frombuffer(raw, dtype=OFFSET_DTYPE).astype(np.int64)
                self._offsets[k] = arr
        return arr

    def _read_local(self, k: int, lo: int, hi: int) -> np.ndarray:
        return np.asarray(self.shard_tokens(k)[lo:hi])

    # -- stream access -----------------------------------------------------------------------------
    def _pieces(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """Split the global range [start, stop) into (shard, lo, hi) pieces."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"token range [{start}, {stop}) outside source {self.name} of {self.num_tokens} tokens")
        out = []
        k = int(np.searchsorted(self.token_starts, start, side="right")) - 1
        pos = start
        while pos < stop:
            base = int(self.token_starts[k])
            hi = min(stop, int(self.token_starts[k + 1]))
            out.append((k, pos - base, hi - base))
            pos = hi
            k += 1
        return out

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the source's stream, as uint32 (a copy)."""
        return self.read_many([(start, stop)])[0]

    def read_many(self, ranges: Sequence[tuple[int, int]]) -> list[np.ndarray]:
        """Several ranges at once; remote stores fetch every piece concurrently (one ranged GET each)."""
        return read_ranges([(self, a, b) for a, b in ranges])

    def document_range(self, doc: int) -> tuple[int, int]:
        """Global [start, stop) token range of global document ``doc`` (its EOS included)."""
        if not 0 <= doc < self.num_documents:
            raise IndexError(f"document {doc} outside source {self.name} of {self.num_documents} documents")
        k = int(np.searchsorted(self.doc_starts, doc, side="right")) - 1
        offs = self.doc_offsets(k)
        j = doc - int(self.doc_starts[k])
        base = int(self.token_starts[k])
        return base + int(offs[j]), base + int(offs[j + 1])

    def document(self, doc: int) -> np.ndarray:
        """Tokens of one document (ending with EOS)."""
        return self.read(*self.document_range(doc))

    def token_offset_of_document(self, doc: int) -> int:
        """Global token index where document ``doc`` starts (``num_tokens`` for doc == num_documents)."""
        if doc == self.num_documents:
            return self.num_tokens
        return self.document_range(doc)[0]


def read_ranges(requests: Sequence[tuple[SourceReader, int, int]]) -> list[np.ndarray]:
    """Token ranges ``(reader, start, stop)`` from any mix of sources and stores, in request order.

    Local pieces are slices of memory maps; remote pieces on the same filesystem go out together in
    one ``cat_ranges`` call (concurrent ranged GETs), so a batch drawing rows from 40 remote sources
    costs one round of requests, not 40.
    """
    plans = [r._pieces(a, b) for r, a, b in requests]
    parts: list[list[np.ndarray | None]] = [[None] * len(p) for p in plans]
    remote: dict[int, list[tuple[int, int, str, int, int]]] = {}
    fss: dict[int, object] = {}
    for i, ((reader, _, _), plan) in enumerate(zip(requests, plans)):
        for j, (k, lo, hi) in enumerate(plan):
            if reader.is_local:
                parts[i][j] = reader._read_local(k, lo, hi)
            else:
                remote.setdefault(id(reader._fs), []).append((i, j, reader.shards[k].tokens_path, lo, hi))
                fss[id(reader._fs)] = reader._fs
    for key, items in remote.items():
        blobs = fss[key].cat_ranges([p for _, _, p, _, _ in items],
                                    [lo * TOKEN_DTYPE.itemsize for *_, lo, _ in items],
                                    [hi * TOKEN_DTYPE.itemsize for *_, hi in items])
        for (i, j, *_), blob in zip(items, blobs):
            if isinstance(blob, Exception):
                raise blob
            parts[i][j] = np.frombuffer(blob, dtype=TOKEN_DTYPE)
    return [np.zeros(0, TOKEN_DTYPE) if not p else p[0].copy() if len(p) == 1 else np.concatenate(p)
            for p in parts]


class TokenStore:
    """A finished token store: its manifest plus readers for each source."""

    def __init__(self, path: str, manifest: dict):
        self.path = path.rstrip("/")
        self.manifest = manifest
        self._readers: dict[str, SourceReader] = {}

    @classmethod
    def open(cls, path: str, tokenizer=None) -> TokenStore:
        """Open a store. ``tokenizer`` (LoadedTokenizer, tokenizer path, or identity hex) is checked if given."""
        mpath = f"{path.rstrip('/')}/{MANIFEST}"
        try:
            with fsspec.open(mpath, "r") as f:
                manifest = json.load(f)
        except FileNotFoundError as e:
            raise StoreError(
                f"no token store at {path}: {MANIFEST} is missing (was the tokenize step run to completion?)"
            ) from e
        if manifest.get("format") != STORE_FORMAT:
            raise StoreError(f"{mpath}: format {manifest.get('format')!r} is not {STORE_FORMAT!r}")
        store = cls(path, manifest)
        if tokenizer is not None:
            store.check_tokenizer(tokenizer)
        return store

    @property
    def tokenizer_identity(self) -> str:
        return self.manifest["tokenizer"]["identity"]

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.manifest["tokenizer"]["eos_id"])

    @cached_property
    def source_names(self) -> tuple[str, ...]:
        return tuple(sorted(self.manifest["sources"]))

    def check_tokenizer(self, expected) -> None:
        """Raise :class:`TokenizerMismatchError` unless ``expected`` is the tokenizer the store was written with."""
        ident, desc = _expected_identity(expected)
        if ident != self.tokenizer_identity:
            written = self.manifest["tokenizer"]
            raise TokenizerMismatchError(
                f"token store {self.path} was written with tokenizer {written['identity'][:16]} "
                f"({written.get('path')}), but is being read with tokenizer {ident[:16]} ({desc}); "
                "token ids would mean different strings. Re-tokenize with this tokenizer or read with the original."
            )

    def source(self, name: str) -> SourceReader:
        r = self._readers.get(name)
        if r is None:
            try:
                entry = self.manifest["sources"][name]
            except KeyError:
                raise KeyError(
                    f"source {name!r} not in token store {self.path}; it has {list(self.source_names)}"
                ) from None
            r = self._readers[name] = SourceReader(self.path, name, entry)
        return r
