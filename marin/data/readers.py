"""Read documents from jsonl / parquet files (optionally .gz / .zst) on any fsspec filesystem.

Two kinds of badness are kept apart on purpose:

* a bad *document* (invalid UTF-8, empty text, over the size limit, missing text field, a line that is
  not JSON) is yielded with a ``skip`` reason so callers count it and carry on;
* a corrupt *file* (truncated gzip, broken zstd frame, unreadable parquet) raises
  :class:`CorruptInputError` naming the file, because nothing after the damage can be trusted.

What a step does with a corrupt file is its ``on_corrupt`` policy (:func:`check_corrupt_policy`):
``"skip"`` leaves the whole file out (listed with its reason) as long as at most
``max_corrupt_fraction`` of the files are corrupt; ``"fail"`` fails the step on any corrupt file.
With millions of files one damaged file is normal, so the default is skip with a small budget.
"""

from __future__ import annotations

import functools
import gzip
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import fsspec

DOC_EXTENSIONS = (".jsonl", ".ndjson", ".parquet")  # not ".json": manifests live beside the data
COMPRESSIONS = ("", ".gz", ".zst")

SKIP_INVALID_UTF8 = "invalid_utf8"
SKIP_INVALID_JSON = "invalid_json"
SKIP_MISSING_TEXT = "missing_text"
SKIP_EMPTY = "empty"
SKIP_TOO_LARGE = "too_large"


ON_CORRUPT = ("fail", "skip")
DEFAULT_ON_CORRUPT = "skip"
DEFAULT_MAX_CORRUPT_FRACTION = 0.01


class CorruptInputError(RuntimeError):
    """An input file cannot be read past some point. The message names the file."""

    def __init__(self, path: str, cause: BaseException | str):
        self.path = path
        detail = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"corrupt input file {path}: {detail}")


class TooManyCorruptFilesError(RuntimeError):
    """More input files are corrupt than the step's policy allows; the message names them."""


def validate_corrupt_policy(on_corrupt: str, max_corrupt_fraction: float) -> None:
    """Refuse a policy that is not one (before any file is read)."""
    if on_corrupt not in ON_CORRUPT:
        raise ValueError(f"on_corrupt must be one of {ON_CORRUPT}, got {on_corrupt!r}")
    if not 0.0 <= max_corrupt_fraction <= 1.0:
        raise ValueError(f"max_corrupt_fraction must be in [0, 1], got {max_corrupt_fraction!r}")


def corrupt_policy_violation(n_corrupt: int, n_files: int, on_corrupt: str, max_corrupt_fraction: float) -> str | None:
    """Why ``n_corrupt`` corrupt files out of ``n_files`` fail the step under the policy, or None if
    the corrupt files may be skipped."""
    if n_corrupt == 0:
        return None
    if on_corrupt == "fail":
        return "on_corrupt='fail'"
    if n_corrupt > max_corrupt_fraction * n_files:
        return (f"{n_corrupt / n_files:.1%} of the files are corrupt, more than max_corrupt_fraction="
                f"{max_corrupt_fraction} allows with on_corrupt='skip'")
    return None


DAMAGED_SKIPS = (SKIP_INVALID_UTF8, SKIP_INVALID_JSON)
"""Skip reasons that mean the bytes are damaged (not merely an unusable document): they count
against the corrupt-input policy like corrupt files do."""


def damaged_documents_violation(n_damaged: int, n_records: int, max_corrupt_fraction: float) -> str | None:
    """Why ``n_damaged`` damaged records (invalid UTF-8 or JSON) out of ``n_records`` fail the step, or
    None: the document-level twin of :func:`corrupt_policy_violation`, since a file of garbage lines
    reads to its end and is never a corrupt *file*. Damaged documents are skipped and counted under
    either ``on_corrupt`` policy (which is about files) while they are at most
    ``max_corrupt_fraction`` of the records."""
    if n_damaged == 0 or n_damaged <= max_corrupt_fraction * n_records:
        return None
    return (f"{n_damaged} of {n_records} documents ({n_damaged / n_records:.1%}) are damaged (invalid JSON or UTF-8), "
            f"more than max_corrupt_fraction={max_corrupt_fraction} allows")


@dataclass(frozen=True)
class Record:
    """One input record. ``text`` is None exactly when ``skip`` says why the record is unusable."""

    index: int
    text: str | None
    nbytes: int = 0
    skip: str | None = None


def is_document_file(path: str) -> bool:
    return any(path.endswith(ext + comp) for ext in DOC_EXTENSIONS for comp in COMPRESSIONS)


def list_document_files(root: str) -> list[str]:
    """Every document file under ``root`` (recursive), as full fsspec URLs, sorted."""
    fs, base = fsspec.core.url_to_fs(root)
    fs.invalidate_cache(base)  # object-store listings are cached per process
    if fs.isfile(base):
        return [root]
    found = fs.find(base)
    return sorted(fs.unstrip_protocol(p) if "://" in root else p for p in found if is_document_file(p))


@functools.cache  # the same on every call; without it, each file paid for two import look-ups
def _corruption_errors() -> tuple[type[BaseException], ...]:
    errs: list[type[BaseException]] = [EOFError, zlib.error, gzip.BadGzipFile, OSError]
    try:
        import zstandard  # zstandard: the data extra, only for .zst files

        errs.append(zstandard.ZstdError)
    except ImportError:  # pragma: no cover
        pass
    try:
        import pyarrow  # pyarrow: the data extra (slow to import), only for parquet

        errs.append(pyarrow.ArrowException)
    except ImportError:  # pragma: no cover
        pass
    return tuple(errs)


def _check_text(index: int, text: object, max_doc_bytes: int | None) -> Record:
    if not isinstance(text, str):
        return Record(index, None, 0, SKIP_MISSING_TEXT)
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates from "\udc80"-style escapes
        return Record(index, None, 0, SKIP_INVALID_UTF8)
    if not text.strip():
        return Record(index, None, len(raw), SKIP_EMPTY)
    if max_doc_bytes is not None and len(raw) > max_doc_bytes:
        return Record(index, None, len(raw), SKIP_TOO_LARGE)
    return Record(index, text, len(raw))


def _iter_lines(f, chunk_size: int = 1 << 20) -> Iterator[bytes]:
    """Lines of a binary stream. Chunked by hand: decompressing streams (zstd) lack readline()."""
    rest = b""
    while True:
        chunk = f.read(chunk_size)
        if not chunk:
            break
        lines = (rest + chunk).split(b"\n")
        rest = lines.pop()
        yield from lines
    if rest:
        yield rest


def _iter_jsonl(f, text_field: str, max_doc_bytes: int | None) -> Iterator[Record]:
    records = (line for line in _iter_lines(f) if line.strip())  # blank lines are not records
    for index, line in enumerate(records):
        try:
            obj = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:  # before ValueError, its base class
            yield Record(index, None, len(line), SKIP_INVALID_UTF8)
            continue
        except ValueError:
            yield Record(index, None, len(line), SKIP_INVALID_JSON)
            continue
        yield _check_text(index, obj.get(text_field) if isinstance(obj, dict) else None, max_doc_bytes)


def _iter_parquet(f, text_field: str, max_doc_bytes: int | None) -> Iterator[Record]:
    import pyarrow.parquet as pq  # pyarrow: the data extra (slow to import), only for parquet

    pf = pq.ParquetFile(f)
    if text_field not in pf.schema_arrow.names:
        for i in range(pf.metadata.num_rows):
            yield Record(i, None, 0, SKIP_MISSING_TEXT)
        return
    batches = pf.iter_batches(batch_size=4096, columns=[text_field])
    values = (v for batch in batches for v in batch.column(0).to_pylist())
    for index, value in enumerate(values):
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError:
                yield Record(index, None, len(value), SKIP_INVALID_UTF8)
                continue
        yield _check_text(index, value, max_doc_bytes)


class _CheckedZstdReader:
    """``read(n)`` over a (multi-frame) zstd stream that raises if the file ends inside a frame.

    zstandard's stream reader reports a clean end of file on a truncated file, which would silently
    drop everything after the cut; a truncated download must be a corrupt file instead."""

    def __init__(self, raw) -> None:
        import zstandard  # zstandard: the data extra, only for .zst files

        self._raw = raw
        self._dctx = zstandard.ZstdDecompressor()
        self._frame = self._dctx.decompressobj()
        self._in_frame = False
        self._buf = b""

    def read(self, n: int = -1) -> bytes:
        import zstandard  # zstandard: the data extra, only for .zst files

        while n < 0 or len(self._buf) < n:
            chunk = self._raw.read(1 << 20)
            if not chunk:
                if self._in_frame:
                    raise zstandard.ZstdError("truncated zstd stream: the file ends inside a frame")
                break
            while chunk:
                self._in_frame = True
                self._buf += self._frame.decompress(chunk)
                if not self._frame.eof:
                    break
                chunk = self._frame.unused_data  # the next frame, if any
                self._frame = self._dctx.decompressobj()
                self._in_frame = False
        if n < 0:
            out, self._buf = self._buf, b""
        else:
            out, self._buf = self._buf[:n], self._buf[n:]
        return out


def iter_documents(path: str, text_field: str = "text", max_doc_bytes: int | None = None) -> Iterator[Record]:
    """Yield every record of one file in order; raise :class:`CorruptInputError` if the file is damaged."""
    errors = _corruption_errors()
    name = path.rsplit("/", 1)[-1]
    try:
        if name.endswith(".zst") and ".parquet" not in name:
            with fsspec.open(path, "rb") as raw:
                yield from _iter_jsonl(_CheckedZstdReader(raw), text_field, max_doc_bytes)
            return
        with fsspec.open(path, "rb", compression="infer") as f:
            if ".parquet" in name:
                yield from _iter_parquet(f, text_field, max_doc_bytes)
            else:
                yield from _iter_jsonl(f, text_field, max_doc_bytes)
    except FileNotFoundError:
        raise
    except errors as e:
        raise CorruptInputError(path, e) from e


def iter_record_lines(path: str) -> Iterator[bytes]:
    """The raw bytes of every record line of one jsonl file (optionally .gz / .zst), numbered as
    :func:`iter_documents` numbers its records (blank lines are not records), so a step that
    filters documents can write the kept records back byte for byte, every field included; raise
    :class:`CorruptInputError` if the file is damaged."""
    errors = _corruption_errors()
    name = path.rsplit("/", 1)[-1]
    try:
        if name.endswith(".zst"):
            with fsspec.open(path, "rb") as raw:
                yield from (line for line in _iter_lines(_CheckedZstdReader(raw)) if line.strip())
            return
        with fsspec.open(path, "rb", compression="infer") as f:
            yield from (line for line in _iter_lines(f) if line.strip())
    except FileNotFoundError:
        raise
    except errors as e:
        raise CorruptInputError(path, e) from e
