"""The dedup step: exact and near-duplicate documents removed from a corpus in the K40 layout.

Input and output are both document files in the layout the tokenize step reads (one directory per
source, ``domain/bucket`` for K40; jsonl, .gz, .zst or parquet): every input file becomes one output
file of the same name and format holding its surviving records byte for byte (every field kept), so
``default_tokenize`` reads the output unchanged. The work runs in four phases, each a set of Ray tasks
(or in this process without Ray), each restartable:

1. **signatures**, one task per input file: every document's words are normalised (NFKC, case
   folded, punctuation and whitespace dropped), its normalised text hashed (the exact-duplicate
   key), its word ``shingle_size``-grams hashed (vectorised, one 64-bit hash a shingle) and
   MinHashed from those hashes (``num_perm = bands x rows`` values, by ``rensa``, one call per batch);
   the signature is cut into ``bands`` bands of ``rows`` values and each band hashed into a 64-bit
   key. Keys are written partitioned by (band, key range), so phase 2 reads one partition of one
   band from every file; the shingle hashes (32 bits each) are kept to verify candidates;
2. **candidate pairs**, one task per key partition: in each band, the keys of that slice of the
   corpus are sorted; documents sharing a key are candidates, and a candidate pair counts only if
   the Jaccard similarity of its two shingle sets (computed from the stored hashes, not estimated
   from the signatures) is at least ``threshold``; the exact-text hash is one more band, whose pairs
   need no verification. A task holds one partition of every band (12 bytes per document per band)
   and the shingle sets of its candidates: memory is bounded by ``partition_bytes`` of input, never
   by the corpus;
3. **clusters**: the verified pairs are joined into connected components (duplicate pairs only, a
   small fraction of the documents); in each cluster the survivor is the document from the highest
   quality bucket (``q5`` before ``q1``), then the first by source name, file path and record
   number. Every other member is removed, as an ``exact_duplicate`` if some other document has the
   same normalised text, else as a ``near_duplicate``;
4. **survivors**, one task per input file: the kept records written to the output.

A document pair becomes a candidate with probability ``1 - (1 - J^rows)^bands`` at Jaccard
similarity J of their shingle sets. The defaults (20 bands of 5 rows over 5-word shingles) put the
S-curve's midpoint at 0.55, well below the verified ``threshold`` of 0.7, so a pair at the threshold
is a candidate with probability 0.975 and one at 0.8 with 0.9995; the extra candidates below the
threshold cost one set comparison each, never a removal.

Every task writes its outputs, then a ``.json`` marker; a rerun after a kill skips every finished
task of every phase (a marker records the inputs' sizes and the parameters it was made with, and is
redone if they changed). Bad documents are counted per reason and dropped; a corrupt file follows
the corrupt-input policy of every corpus step (``CorpusInput.on_corrupt``, ``max_corrupt_fraction``;
:mod:`marin.data.corpus_steps` is the frame these phases run in): skipped files are left out of the
output and listed in the manifest. ``dedup_manifest.json`` is written
last, only when the step succeeds; the work files under ``_work/`` are then removed.
"""

from __future__ import annotations

import array
import hashlib
import itertools
import logging
import re
import time
import unicodedata
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
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
    read_marker,
    run_tasks,
    summarize,
    write_json,
    write_kept_records,
)
from marin.data.k40 import split_source_name
from marin.data.readers import iter_documents
from marin.execution.versioning import input_field, live

logger = logging.getLogger(__name__)

DEDUP_MANIFEST = "dedup_manifest.json"
SCOPES = ("corpus", "domain", "source")
REASON_EXACT = "exact_duplicate"
REASON_NEAR = "near_duplicate"
SIGNATURE_BATCH_BYTES = 1 << 20
"""Normalised text shingled and MinHashed at a time (the hashing holds about 40 bytes per byte of
it): a task's memory is its file's signatures (400 bytes a document by default) and this batch."""


class DedupError(CorpusStepError):
    """The step cannot produce a deduplicated corpus; the message says why (each failed file named)."""


STEP = CorpusStep("dedup", DedupError, DEDUP_MANIFEST, "dedup_failures.json")


# --------------------------------------------------------------------------------------------------
# Normalisation and hashing (pure functions)

WORD_RE = re.compile(r"\w+")


def normalize_words(text: str) -> list[str]:
    """The words of ``text`` as every dedup and decontamination comparison sees them: runs of letters
    and digits, each NFKC-normalised and case folded; punctuation and whitespace are dropped."""
    if text.isascii():
        return normalized_text(text).split()
    return [unicodedata.normalize("NFKC", w).casefold() for w in WORD_RE.findall(text)]


def word_spans(text: str) -> list[tuple[str, int, int]]:
    """(normalised word, start, end) for each word of ``text``: :func:`normalize_words` with the
    characters each word came from, so a matching span can be cut out of the original text."""
    if text.isascii():
        return [(m.group().lower(), m.start(), m.end()) for m in WORD_RE.finditer(text)]
    return [(unicodedata.normalize("NFKC", m.group()).casefold(), m.start(), m.end()) for m in WORD_RE.finditer(text)]


_ASCII_WORD_BYTES = bytes(c if c < 128 and (chr(c).isalnum() or c == 0x5F) else 0x20 for c in range(256))
"""Every ASCII byte that is not a word character (``\\w``: letters, digits, underscore) -> a space."""


def normalized_text(text: str) -> str:
    """The normalised words of ``text`` joined by one space: ``" ".join(normalize_words(text))``.
    ASCII text (most of a corpus) takes a byte-translation path about 3x faster than the regular
    expression; other text goes word by word through :func:`normalize_words`."""
    if text.isascii():  # the same words as WORD_RE (\\w+) finds in ASCII text
        return b" ".join(text.encode("ascii").lower().translate(_ASCII_WORD_BYTES).split()).decode("ascii")
    return " ".join(normalize_words(text))


def content_hash(words: Sequence[str]) -> int:
    """The exact-duplicate key: a 64-bit hash of the normalised text (words joined by one space)."""
    return text_hash(" ".join(words))


def text_hash(normalized: str) -> int:
    """:func:`content_hash` of a text already normalised by :func:`normalized_text`."""
    return int.from_bytes(hashlib.blake2b(normalized.encode("utf-8"), digest_size=8).digest(), "little")


def shingles(words: Sequence[str], n: int) -> list[str]:
    """The word ``n``-grams of a document (its whole text as one shingle when it is shorter)."""
    if len(words) <= n:
        return [" ".join(words)] if words else []
    return [" ".join(words[i:i + n]) for i in range(len(words) - n + 1)]


def implied_threshold(bands: int, rows: int) -> float:
    """The Jaccard similarity at which a pair becomes a candidate with probability about one half."""
    return (1.0 / bands) ** (1.0 / rows)


def candidate_probability(jaccard: float, bands: int, rows: int) -> float:
    """Probability that two documents of Jaccard similarity ``jaccard`` share at least one band."""
    return 1.0 - (1.0 - jaccard ** rows) ** bands


_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective 64-bit mix, so distinct inputs stay distinct."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def band_keys(signatures: np.ndarray, bands: int, rows: int, salt: int = 0) -> np.ndarray:
    """[n, bands] uint64: one key per band of each signature (its ``rows`` values hashed in order).

    ``salt`` is mixed into every key: documents with different salts never share a key (the
    per-domain and per-source scopes)."""
    n = signatures.shape[0]
    if signatures.shape[1] < bands * rows:
        raise ValueError(f"signatures have {signatures.shape[1]} values, bands x rows needs {bands * rows}")
    s = signatures[:, : bands * rows].reshape(n, bands, rows).astype(np.uint64)
    k = mix64(np.arange(bands, dtype=np.uint64) + np.uint64(salt & 0xFFFFFFFFFFFFFFFF))[None, :].repeat(n, 0)
    for r in range(rows):
        k = mix64(k ^ s[:, :, r])
    return k


_BASE = 0x9E3779B97F4A7C15  # odd, so invertible modulo 2^64
_BASE_INV = pow(_BASE, -1, 1 << 64)
_POWERS: list[np.ndarray] = []  # [B^j, B^-j] for j < their length, grown on demand (per process)


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    if not _POWERS or _POWERS[0].size < n:
        size = max(n, 1 << 20)
        pw, inv = np.full(size, _BASE, dtype=np.uint64), np.full(size, _BASE_INV, dtype=np.uint64)
        pw[0] = inv[0] = 1
        with np.errstate(over="ignore"):
            _POWERS[:] = [np.cumprod(pw), np.cumprod(inv)]  # wraps modulo 2^64, as the hash wants
    return _POWERS[0], _POWERS[1]


def shingle_hashes(texts: Sequence[str], n: int) -> tuple[np.ndarray, np.ndarray]:
    """The word ``n``-grams of each normalised text (:func:`normalized_text`) as 64-bit hashes, without
    building one Python string per shingle (which dominated the step's time).

    Returns (flat uint64 hashes, uint64 offsets [len(texts) + 1]): document ``d``'s shingles are
    ``flat[offsets[d]:offsets[d + 1]]``, in word order; a text shorter than ``n`` words is one shingle,
    an empty one has none. Each hash is the polynomial hash modulo 2^64 of the shingle's UTF-8 bytes
    (``" ".join(words[i:i + n])``, base ``_BASE``), finalised by :func:`mix64`: a pure function of
    the shingle's text, the same in every process (no per-process salt)."""
    d_count = len(texts)
    data = np.frombuffer("\n".join(texts).encode("utf-8"), dtype=np.uint8)
    if data.size == 0:
        return np.zeros(0, np.uint64), np.zeros(d_count + 1, np.uint64)
    sep = (data == 32) | (data == 10)
    newline = np.flatnonzero(data == 10)
    doc_start = np.concatenate([[0], newline + 1])
    word_start = np.flatnonzero(~sep & np.concatenate([[True], sep[:-1]]))
    word_end = np.flatnonzero(~sep & np.concatenate([sep[1:], [True]])) + 1
    doc_of = np.searchsorted(doc_start, word_start, side="right") - 1
    words = np.bincount(doc_of, minlength=d_count)
    first_word = np.concatenate([[0], np.cumsum(words)])
    # n-grams inside one document: word j to word j + n - 1
    j = np.arange(max(0, word_start.size - n + 1))
    j = j[doc_of[j] == doc_of[j + n - 1]] if j.size else j
    starts, ends, owner = word_start[j], word_end[j + n - 1], doc_of[j]
    short = np.flatnonzero((words > 0) & (words < n))  # the whole text as one shingle
    if short.size:
        starts = np.concatenate([starts, word_start[first_word[short]]])
        ends = np.concatenate([ends, word_end[first_word[short + 1] - 1]])
        owner = np.concatenate([owner, short])
        order = np.argsort(owner, kind="stable")
        starts, ends, owner = starts[order], ends[order], owner[order]
    pw, inv = _powers(data.size + 1)
    with np.errstate(over="ignore"):
        prefix = np.zeros(data.size + 1, dtype=np.uint64)
        np.cumsum((data.astype(np.uint64) + np.uint64(1)) * inv[: data.size], out=prefix[1:])
        h = (prefix[ends] - prefix[starts]) * pw[ends - 1]
    offsets = np.zeros(d_count + 1, dtype=np.uint64)
    np.cumsum(np.bincount(owner, minlength=d_count), out=offsets[1:])
    return mix64(h), offsets


def minhash_signatures(hashes: np.ndarray, offsets: np.ndarray, num_perm: int, seed: int) -> np.ndarray:
    """[n, num_perm] uint32 MinHash signatures by rensa (the fastest of the libraries measured here;
    see docs/data.md) of the shingle hashes of :func:`shingle_hashes`, in one call per batch."""
    from rensa import RMinHash  # rensa: the data extra, only when a dedup step runs

    n = offsets.size - 1
    if n == 0:
        return np.zeros((0, num_perm), dtype=np.uint32)
    matrix = RMinHash.digest_matrix_from_flat_token_hashes(hashes, offsets, num_perm, seed)
    # the matrix offers only Python lists (its rows); array.array is the fastest way from them to numpy
    flat = array.array("I", itertools.chain.from_iterable(matrix.to_rows()))
    assert flat.itemsize == 4, "array typecode I is not 32 bits on this platform"
    return np.frombuffer(flat, dtype=np.uint32).reshape(n, num_perm).copy()


def jaccard_of_sets(a: np.ndarray, b: np.ndarray) -> float:
    """Jaccard similarity of two sets given as sorted arrays of unique values (0 when both are empty)."""
    inter = np.intersect1d(a, b, assume_unique=True).size
    union = a.size + b.size - inter
    return inter / union if union else 0.0


def resolve_clusters(pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Connected components of the graph whose edges are ``pairs`` ([E, 2] document ids).

    Returns (nodes, roots): every id that appears in a pair, sorted, and the smallest id of its
    component (the survivor, since ids sort by the survivor rule). Label propagation with pointer
    jumping, vectorised: O(E log E) per round, O(log diameter) rounds."""
    pairs = np.asarray(pairs, dtype=np.uint64).reshape(-1, 2)
    nodes, inv = np.unique(pairs, return_inverse=True)
    if nodes.size == 0:
        return nodes, nodes.copy()
    a, b = inv.reshape(-1, 2)[:, 0], inv.reshape(-1, 2)[:, 1]
    label = np.arange(nodes.size)
    while True:
        low = np.minimum(label[a], label[b])
        new = label.copy()
        np.minimum.at(new, a, low)
        np.minimum.at(new, b, low)
        new = new[new]  # pointer jumping: follow each label to its label
        while True:
            nxt = new[new]
            if np.array_equal(nxt, new):
                break
            new = nxt
        if np.array_equal(new, label):
            break
        label = new
    return nodes, nodes[label]


def doc_id(file_index: int | np.ndarray, record: int | np.ndarray) -> np.ndarray:
    """A corpus-wide document id: the file's rank in survivor order, then the record number."""
    return (np.asarray(file_index, dtype=np.uint64) << np.uint64(32)) | np.asarray(record, dtype=np.uint64)


def scope_salt(scope: str, source: str) -> int:
    """What separates documents that may not be duplicates of each other under ``scope``."""
    if scope == "corpus":
        return 0
    key = split_source_name(source)[0] if scope == "domain" else source
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def write_array(path: str, arr: np.ndarray) -> None:
    fs, p = fsspec.core.url_to_fs(path)
    fs.makedirs(p.rsplit("/", 1)[0], exist_ok=True)
    with fsspec.open(path, "wb") as f:
        np.save(f, arr, allow_pickle=False)


def read_array(path: str) -> np.ndarray:
    with fsspec.open(path, "rb") as f:
        return np.load(f, allow_pickle=False)


# --------------------------------------------------------------------------------------------------
# The step


@dataclass(frozen=True)
class DedupConfig:
    """Remove exact and near-duplicate documents from the corpus at ``input_path`` (read as ``input``
    says: :class:`~marin.data.corpus_steps.CorpusInput`) into ``output_path``."""

    input_path: str = input_field()
    output_path: str = input_field()
    input: CorpusInput = input_group()
    exact: bool = True
    """Remove documents whose normalised text equals another's."""
    fuzzy: bool = True
    """Remove near-duplicates found by MinHash LSH."""
    shingle_size: int = 5
    """Words per shingle."""
    num_perm: int = 100
    """MinHash values per document; must equal ``bands * rows``."""
    bands: int = 20
    rows: int = 5
    """LSH banding: a pair of Jaccard similarity J becomes a candidate with probability
    ``1 - (1 - J^rows)^bands`` (0.975 at J = 0.7 for 20 x 5, 0.9995 at J = 0.8)."""
    threshold: float = 0.7
    """A candidate pair is a near-duplicate when the Jaccard similarity of its shingle sets (computed
    exactly from the shingle hashes, not estimated from the signatures) is at least this."""
    seed: int = 1
    """Seed of the MinHash permutations."""
    scope: str = "corpus"
    """Who may duplicate whom: "corpus" (within and across domains), "domain" (only within a domain),
    "source" (only within a domain's quality bucket)."""
    sample_pairs: int = 20
    """Removed documents listed in the manifest with their survivor and estimated similarity."""
    partition_bytes: int = live("how the band index is split over tasks (memory per task); the pairs found, "
                                "and so the output, are the same", default=1 << 30)
    """Input bytes per band partition: a pair task holds the band keys of about this much text."""
    keep_work: bool = live("whether the intermediate signatures stay after success, not the output",
                           default=False)

    @property
    def implied_threshold(self) -> float:
        """The Jaccard similarity at which the bands and rows make a pair a candidate with
        probability one half (the S-curve's midpoint, below ``threshold`` by design)."""
        return implied_threshold(self.bands, self.rows)

    def params(self) -> dict[str, Any]:
        """What every intermediate file depends on (recorded in each work marker)."""
        return {"text_field": self.input.text_field, "max_doc_bytes": self.input.max_doc_bytes, "exact": self.exact,
                "fuzzy": self.fuzzy, "shingle_size": self.shingle_size, "num_perm": self.num_perm,
                "bands": self.bands, "rows": self.rows, "seed": self.seed, "scope": self.scope}


def validate_dedup_config(c: DedupConfig) -> None:
    """Refuse parameters that cannot work, before any file is read."""
    c.input.validate()
    if c.scope not in SCOPES:
        raise DedupError(f"scope must be one of {SCOPES}, got {c.scope!r}")
    if not (c.exact or c.fuzzy):
        raise DedupError("exact and fuzzy are both False: nothing to deduplicate")
    if min(c.shingle_size, c.bands, c.rows, c.num_perm) < 1:
        raise DedupError("shingle_size, num_perm, bands and rows must be positive")
    if c.num_perm != c.bands * c.rows:
        raise DedupError(f"num_perm ({c.num_perm}) must equal bands x rows ({c.bands} x {c.rows} = "
                         f"{c.bands * c.rows})")
    if c.partition_bytes < 1:
        raise DedupError("partition_bytes must be positive")
    if not 0.0 < c.threshold <= 1.0:
        raise DedupError(f"threshold must be in (0, 1], got {c.threshold}")


@dataclass(frozen=True)
class SignatureTask:
    file: InputFile
    work: str
    params: dict
    partitions: int
    marker_fp: str
    salt: int


def signature_paths(work: str, key: str) -> dict[str, str]:
    base = f"{work}/signatures/{key}"
    return {"keys": base + ".keys", "docs": base + ".docs.npz", "sig": base + ".sig.npy",
            "shingles": base + ".shingles", "meta": base + ".json"}


def signature_file(task: SignatureTask) -> dict:
    """Phase 1 for one file: normalise, hash and MinHash every document; write the band keys
    partitioned by (band, key range), the signatures, the shingle hashes (for verifying candidate
    pairs) and the document table; then the marker."""
    f = task.file
    paths = signature_paths(task.work, f.key)
    return file_task(f, paths["meta"], task.marker_fp, lambda: sign_file(task, paths))


def sign_file(task: SignatureTask, paths: Mapping[str, str]) -> dict:
    f, p = task.file, task.params
    records: list[int] = []
    nbytes: list[int] = []
    exact: list[int] = []
    sig_parts: list[np.ndarray] = []
    pending: list[str] = []  # normalised texts not yet MinHashed: a batch at a time
    pending_bytes = 0
    shingle_counts: list[np.ndarray] = []
    skipped: Counter = Counter()
    skipped_bytes = 0
    skip_idx: list[int] = []
    n_records = 0
    fs, sp = fsspec.core.url_to_fs(paths["shingles"])
    fs.makedirs(sp.rsplit("/", 1)[0], exist_ok=True)
    shingle_out = fsspec.open(paths["shingles"], "wb").open()

    def flush() -> None:
        if p["fuzzy"] and pending:
            hashes, offsets = shingle_hashes(pending, p["shingle_size"])
            sig_parts.append(minhash_signatures(hashes, offsets, p["num_perm"], p["seed"]))
            # 32 bits a shingle are enough to verify a pair: a false match between two documents
            # of a few hundred shingles each has probability about 1e-5, and moves their Jaccard by
            # one shingle in hundreds
            shingle_out.write((hashes >> np.uint64(32)).astype("<u4").tobytes())
            shingle_counts.append(np.diff(offsets))
        pending.clear()

    try:
        for rec in iter_documents(f.url, p["text_field"], p["max_doc_bytes"]):
            n_records = rec.index + 1
            if rec.skip is not None:
                skipped[rec.skip] += 1
                skipped_bytes += rec.nbytes
                skip_idx.append(rec.index)
                continue
            text = normalized_text(rec.text)
            records.append(rec.index)
            nbytes.append(rec.nbytes)
            exact.append(text_hash(text) if text else text_hash(rec.text.strip()))
            pending.append(text)
            pending_bytes += len(text)
            if pending_bytes >= SIGNATURE_BATCH_BYTES:
                flush()
                pending_bytes = 0
        flush()
    finally:
        shingle_out.close()
    n = len(records)
    sigs = np.concatenate(sig_parts) if sig_parts else np.zeros((n, p["num_perm"] if p["fuzzy"] else 0), np.uint32)
    counts = np.concatenate(shingle_counts) if shingle_counts else np.zeros(n if p["fuzzy"] else 0, np.uint64)
    has_words = counts > 0
    shingle_offsets = np.zeros(counts.size + 1, dtype=np.uint64)
    np.cumsum(counts, out=shingle_offsets[1:])
    columns: list[np.ndarray] = []  # one key array per band, then the exact hash
    idx = np.arange(n, dtype=np.uint32)
    col_rows: list[np.ndarray] = []
    if p["fuzzy"]:
        keys = band_keys(sigs, p["bands"], p["rows"], task.salt)
        for b in range(p["bands"]):
            columns.append(keys[has_words, b])
            col_rows.append(idx[has_words])
    if p["exact"]:
        ex = np.array(exact, dtype=np.uint64)
        columns.append(mix64(ex ^ np.uint64(task.salt)) if task.salt else ex)
        col_rows.append(idx)
    rec_arr = np.array(records, dtype=np.uint32)
    col_meta = []
    fs, kp = fsspec.core.url_to_fs(paths["keys"])
    fs.makedirs(kp.rsplit("/", 1)[0], exist_ok=True)
    base = 0
    with fsspec.open(paths["keys"], "wb") as out:
        for keys_c, rows_c in zip(columns, col_rows):
            part = keys_c % np.uint64(task.partitions)
            order = np.lexsort((keys_c, part))
            keys_c, recs_c, part = keys_c[order], rec_arr[rows_c[order]], part[order]
            offsets = np.searchsorted(part, np.arange(task.partitions + 1, dtype=np.uint64)).tolist()
            out.write(keys_c.astype("<u8").tobytes())
            out.write(recs_c.astype("<u4").tobytes())
            col_meta.append({"base": base, "n": int(keys_c.size), "offsets": offsets})
            base += keys_c.size * 12
    write_array(paths["sig"], sigs)
    with fsspec.open(paths["docs"], "wb") as out:
        np.savez(out, records=rec_arr, nbytes=np.array(nbytes, dtype=np.uint64),
                 skipped=np.array(skip_idx, dtype=np.uint32), shingle_offsets=shingle_offsets)
    return {"records": n_records, "documents": n, "bytes": int(sum(nbytes)),
            "skipped": dict(sorted(skipped.items())), "skipped_bytes": skipped_bytes, "columns": col_meta,
            "keys_path": paths["keys"]}


@dataclass(frozen=True)
class PairTask:
    partition: int
    work: str
    marker_fp: str
    exact_column: int | None
    threshold: float
    files: tuple  # (file index, keys path, ((base, n, start, end) per column)) per file with keys here


def pair_paths(work: str, partition: int) -> dict[str, str]:
    base = f"{work}/pairs/p{partition:05d}"
    return {"pairs": base + ".npz", "meta": base + ".json"}


def key_groups(keys: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """[E, 2] pairs (smallest id of a key's group, another member) for every key held by several ids."""
    if keys.size == 0:
        return np.zeros((0, 2), np.uint64)
    order = np.lexsort((ids, keys))
    k, d = keys[order], ids[order]
    same = np.zeros(k.size, dtype=bool)
    same[1:] = k[1:] == k[:-1]
    first = np.maximum.accumulate(np.where(~same, np.arange(k.size), 0))
    return np.stack([d[first[same]], d[same]], axis=1).astype(np.uint64)


def key_members(keys: np.ndarray, ids: np.ndarray) -> list[np.ndarray]:
    """The ids of every key held by several ids, one sorted array per key."""
    if keys.size == 0:
        return []
    order = np.lexsort((ids, keys))
    k, d = keys[order], ids[order]
    brk = np.flatnonzero(k[1:] != k[:-1]) + 1
    starts, ends = np.concatenate([[0], brk]), np.concatenate([brk, [k.size]])
    return [d[a:b] for a, b in zip(starts.tolist(), ends.tolist()) if b - a > 1]


MAX_REPRESENTATIVES = 64
"""Representatives per band-key group at most (see :func:`verified_pairs`)."""


def verified_pairs(groups: Iterable[np.ndarray], shingle_sets: Mapping[int, np.ndarray], threshold: float,
                   cache: dict[tuple[int, int], bool]) -> list[tuple[int, int]]:
    """The pairs of documents sharing a band key whose Jaccard similarity is at least ``threshold``.

    In each group (sorted ids) every member is compared with the group's representatives in order,
    the first member being the first representative; a member similar to none becomes one more
    representative. So a group of k copies of one text costs k - 1 comparisons, and a group that
    mixes unrelated documents still links each member to the one it is similar to. A group holds at
    most ``MAX_REPRESENTATIVES`` (a key shared by very many mutually dissimilar documents would
    otherwise cost a comparison per pair); later members are compared with those only. ``cache``
    holds the comparisons already made (a pair shares keys in several bands)."""
    edges: list[tuple[int, int]] = []
    for g in groups:
        members = g.tolist()
        reps = [members[0]]
        for m in members[1:]:
            for r in reps:
                ok = cache.get((r, m))
                if ok is None:
                    ok = cache[(r, m)] = jaccard_of_sets(shingle_sets[r], shingle_sets[m]) >= threshold
                if ok:
                    edges.append((r, m))
                    break
            else:
                if len(reps) < MAX_REPRESENTATIVES:
                    reps.append(m)
    return edges


def read_shingle_sets(files: Mapping[int, str], ids: np.ndarray) -> dict[int, np.ndarray]:
    """{document id: its sorted unique shingle hashes} for ``ids``, read from the signature files
    (``files``: file index -> the work-file base path); one read per document, in file order."""
    out: dict[int, np.ndarray] = {}
    ids = np.unique(np.asarray(ids, dtype=np.uint64))
    file_of = ids >> np.uint64(32)
    for fi in np.unique(file_of).tolist():
        base = files[int(fi)]
        recs = (ids[file_of == fi] & np.uint64(0xFFFFFFFF)).astype(np.uint32)
        with fsspec.open(base + ".docs.npz", "rb") as fh:
            z = np.load(fh, allow_pickle=False)
            records, offsets = z["records"], z["shingle_offsets"]
        pos = np.searchsorted(records, recs)
        with fsspec.open(base + ".shingles", "rb") as fh:
            for rec, i in zip(recs.tolist(), pos.tolist()):
                a, b = int(offsets[i]), int(offsets[i + 1])
                fh.seek(a * 4)
                out[(int(fi) << 32) | rec] = np.unique(np.frombuffer(fh.read((b - a) * 4), dtype="<u4"))
    return out


def band_pairs(task: PairTask) -> dict:
    """Phase 2 for one key partition: in each band, the documents that share a key there become
    candidate pairs, verified by the Jaccard similarity of their shingle sets (at least the
    threshold); the exact-text band's pairs (the same normalised text) need no verification and are
    also kept on their own. Each file's keys file is opened once; the task holds this partition's
    keys of every band, and the shingle sets of its candidates only."""
    paths = pair_paths(task.work, task.partition)
    result = {"partition": task.partition, "path": paths["pairs"], "error": None}
    try:
        done = read_marker(paths["meta"])
        if done and done.get("fingerprint") == task.marker_fp:
            return {**result, **done}
        n_columns = max((len(cols) for _, _, cols in task.files), default=0)
        keys: list[list[np.ndarray]] = [[] for _ in range(n_columns)]
        ids: list[list[np.ndarray]] = [[] for _ in range(n_columns)]
        for file_index, path, cols in task.files:
            with fsspec.open(path, "rb") as f:
                for c, (base, n, start, end) in enumerate(cols):
                    if end <= start:
                        continue
                    f.seek(base + start * 8)
                    keys[c].append(np.frombuffer(f.read((end - start) * 8), dtype="<u8"))
                    f.seek(base + n * 8 + start * 4)
                    ids[c].append(doc_id(file_index, np.frombuffer(f.read((end - start) * 4), dtype="<u4")))
        exact, groups, most = np.zeros((0, 2), np.uint64), [], 0
        for c in range(n_columns):
            k = np.concatenate(keys[c]) if keys[c] else np.zeros(0, np.uint64)
            d = np.concatenate(ids[c]) if ids[c] else np.zeros(0, np.uint64)
            most = max(most, int(k.size))
            if c == task.exact_column:
                exact = key_groups(k, d)
            else:
                groups.extend(key_members(k, d))
        exact_set = set(map(tuple, exact.tolist()))
        bases = {fi: path[: -len(".keys")] for fi, path, _ in task.files}
        sets = read_shingle_sets(bases, np.concatenate(groups)) if groups else {}
        cache: dict[tuple[int, int], bool] = {}
        near = verified_pairs(groups, sets, task.threshold, cache)
        found = [exact, np.array(near, dtype=np.uint64).reshape(-1, 2)]
        pairs = np.unique(np.concatenate(found), axis=0)
        fs, pp = fsspec.core.url_to_fs(paths["pairs"])
        fs.makedirs(pp.rsplit("/", 1)[0], exist_ok=True)
        with fsspec.open(paths["pairs"], "wb") as out:
            np.savez(out, pairs=pairs.reshape(-1, 2), exact=exact)
        candidates = len(set(cache) - exact_set)
        meta = {"fingerprint": task.marker_fp, "pairs": int(pairs.shape[0]), "keys": most,
                "candidates": candidates, "rejected": sum(1 for v in cache.values() if not v)}
        write_json(paths["meta"], meta)
        return {**result, **meta}
    except Exception as e:  # noqa: BLE001 - reported by the step
        result["error"] = f"{type(e).__name__}: {e}"
        return result


@dataclass(frozen=True)
class WriteTask:
    file: InputFile
    work: str
    drop: tuple[int, ...]
    reasons: tuple[str, ...]
    text_field: str
    marker_fp: str


def write_survivors(task: WriteTask) -> dict:
    """Phase 4 for one file: write its kept records; count documents and bytes in and out."""
    return file_task(task.file, f"{task.work}/written/{task.file.key}.json", task.marker_fp,
                     lambda: write_kept_file(task))


def write_kept_file(task: WriteTask) -> dict:
    f = task.file
    with fsspec.open(signature_paths(task.work, f.key)["docs"], "rb") as fh:
        docs = np.load(fh, allow_pickle=False)
        records, nbytes, skipped = docs["records"], docs["nbytes"], docs["skipped"]
    size_of = dict(zip(records.tolist(), nbytes.tolist()))
    removed: Counter = Counter()
    removed_bytes: Counter = Counter()
    for i, why in zip(task.drop, task.reasons):
        removed[why] += 1
        removed_bytes[why] += size_of[i]
    write_kept_records(f.url, f.output, [*task.drop, *skipped.tolist()], task.text_field)
    return {"documents_in": int(records.size), "bytes_in": int(nbytes.sum()),
            "documents_out": int(records.size) - len(task.drop),
            "bytes_out": int(nbytes.sum()) - sum(removed_bytes.values()),
            "removed": dict(removed), "removed_bytes": dict(removed_bytes)}


def _location(files: Sequence[InputFile], i: int) -> dict[str, Any]:
    d = int(i)
    f = files[d >> 32]
    return {"source": f.source, "file": f.rel, "record": d & 0xFFFFFFFF}


def sample_similarities(pairs: Sequence[tuple[int, int]], files: Sequence[InputFile], work: str,
                        records_of: Mapping[int, np.ndarray]) -> list[float | None]:
    """Estimated Jaccard similarity (share of equal MinHash values) of each (removed, survivor) pair."""
    cache: dict[int, np.ndarray] = {}

    def row(d: int) -> np.ndarray | None:
        fi, rec = d >> 32, d & 0xFFFFFFFF
        if fi not in cache:
            cache[fi] = read_array(signature_paths(work, files[fi].key)["sig"])
        pos = int(np.searchsorted(records_of[fi], rec))
        sig = cache[fi]
        return sig[pos] if sig.shape[1] else None

    out: list[float | None] = []
    for a, b in pairs:
        ra, rb = row(int(a)), row(int(b))
        out.append(None if ra is None or rb is None else round(float(np.mean(ra == rb)), 4))
    return out


def dedup(config: DedupConfig) -> None:
    """Executor step: write the deduplicated corpus and ``dedup_manifest.json`` (see module docstring)."""
    validate_dedup_config(config)
    t0 = time.monotonic()
    out = config.output_path.rstrip("/")
    work = f"{out}/{WORK_DIR}"
    inputs = config.input
    files = STEP.plan(config.input_path, out, inputs)
    params = config.params()
    total_bytes = sum(f.size for f in files)
    partitions = max(1, -(-total_bytes // config.partition_bytes))

    # phase 1: signatures per file
    sig_tasks = [SignatureTask(f, work, params, partitions, fingerprint([params, partitions, f.url, f.size, f.index]),
                               scope_salt(config.scope, f.source)) for f in files]
    sizes = [f.size for f in files]
    sig_results = run_tasks(signature_file, sig_tasks, "dedup signatures", inputs, sizes=sizes)
    good, corrupt, _, _ = STEP.check_results(sig_results, out, config.input_path, inputs,
                                             "nothing was written to the output")

    # phase 2: candidate pairs per key partition (every band)
    n_columns = len(good[0]["columns"]) if good else 0
    exact_column = n_columns - 1 if config.exact else None
    plan_fp = fingerprint([params, config.threshold, partitions, [(r["index"], r["fingerprint"]) for r in good]])
    pair_tasks = []
    for p in range(partitions):
        per_file = []
        for r in good:
            cols = tuple((c["base"], c["n"], c["offsets"][p], c["offsets"][p + 1]) for c in r["columns"])
            if any(end > start for _, _, start, end in cols):
                per_file.append((r["index"], r["keys_path"], cols))
        pair_tasks.append(PairTask(p, work, plan_fp, exact_column, config.threshold, tuple(per_file)))
    pair_results = run_tasks(band_pairs, pair_tasks, "dedup pairs", inputs)
    failed = [r for r in pair_results if r["error"]]
    if failed:
        raise DedupError(f"{len(failed)} of {len(pair_results)} key partitions failed (a rerun redoes only them):\n"
                         + "\n".join(f"  partition {r['partition']}: {r['error']}" for r in failed))

    # phase 3: clusters and survivors
    all_pairs, exact_members = [], []
    for r in pair_results:
        if r["pairs"]:
            with fsspec.open(r["path"], "rb") as fh:
                z = np.load(fh, allow_pickle=False)
                all_pairs.append(z["pairs"])
                exact_members.append(z["exact"].reshape(-1))
    # a pair can share keys in bands of different partitions: counted once, whatever the partitioning
    pairs = np.unique(np.concatenate(all_pairs), axis=0) if all_pairs else np.zeros((0, 2), np.uint64)
    nodes, roots = resolve_clusters(pairs)
    is_removed = nodes != roots
    removed, survivor = nodes[is_removed], roots[is_removed]
    exact_ids = np.unique(np.concatenate(exact_members)) if exact_members else np.zeros(0, np.uint64)
    is_exact = np.isin(removed, exact_ids)
    clusters = int(np.unique(roots).size)
    by_file: dict[int, tuple[list[int], list[str]]] = {}
    for d, ex in zip(removed.tolist(), is_exact.tolist()):
        e = by_file.setdefault(d >> 32, ([], []))
        e[0].append(d & 0xFFFFFFFF)
        e[1].append(REASON_EXACT if ex else REASON_NEAR)

    # phase 4: survivors written per file
    write_tasks = []
    for r in good:
        f = files[r["index"]]
        drop, why = by_file.get(f.index, ([], []))
        write_tasks.append(WriteTask(f, work, tuple(drop), tuple(why), inputs.text_field,
                                     fingerprint([plan_fp, drop, why, f.output])))
    written = run_tasks(write_survivors, write_tasks, "dedup write", inputs,
                        sizes=[files[r["index"]].size for r in good])
    STEP.check_failures(written, out, "fail", 0.0, "write")
    for w, r in zip(written, good):
        w["skipped"] = r["skipped"]

    # the manifest: counts, clusters, a sample of removed pairs
    step = max(1, removed.size // max(1, config.sample_pairs)) if config.sample_pairs else 0
    picks = list(range(0, removed.size, step))[: config.sample_pairs] if step else []
    records_of = {}
    if picks:
        for fi in {int(removed[i]) >> 32 for i in picks} | {int(survivor[i]) >> 32 for i in picks}:
            with fsspec.open(signature_paths(work, files[fi].key)["docs"], "rb") as fh:
                records_of[fi] = np.load(fh, allow_pickle=False)["records"]
    sims = sample_similarities([(removed[i], survivor[i]) for i in picks], files, work, records_of)
    sample = [{"removed": _location(files, removed[i]), "kept": _location(files, survivor[i]),
               "reason": REASON_EXACT if is_exact[i] else REASON_NEAR, "similarity": s} for i, s in zip(picks, sims)]
    summary = summarize(written, (REASON_EXACT, REASON_NEAR))
    manifest = {
        "kind": "dedup",
        "input_path": config.input_path,
        "params": {**params, "threshold": config.threshold, "implied_threshold": round(config.implied_threshold, 4),
                   "candidate_probability_at_threshold": round(candidate_probability(config.threshold, config.bands,
                                                                                     config.rows), 4),
                   "partitions": partitions,
                   "on_corrupt": inputs.on_corrupt, "max_corrupt_fraction": inputs.max_corrupt_fraction,
                   "survivor_rule": "highest quality bucket, then first by source, file path and record"},
        **summary,
        "clusters": clusters,
        "candidate_pairs": sum(r.get("candidates", 0) for r in pair_results),
        "rejected_pairs": sum(r.get("rejected", 0) for r in pair_results),
        "duplicate_pairs": int(pairs.shape[0]),
        "sample": sample,
        "skipped_files": [{"source": r["source"], "input_file": r["url"], "reason": r["error"]} for r in corrupt],
        "seconds": round(time.monotonic() - t0, 3),
    }
    manifest["totals"]["skipped_files"] = len(corrupt)
    STEP.finish(out, manifest, config.keep_work)
    t = manifest["totals"]
    logger.info("dedup %s: %d -> %d documents (%s removed), %d clusters, %d corrupt files skipped", out,
                t["documents_in"], t["documents_out"], t["removed"], clusters, len(corrupt))

