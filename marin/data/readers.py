"""Read documents from jsonl / parquet files (optionally .gz / .zst) on any fsspec filesystem.

Two kinds of badness are kept apart on purpose:

* a bad *document* (invalid UTF-8, empty text, over the size limit, missing text field, a line that is
  not JSON) is yielded with a ``skip`` reason so callers count it and carry on;
* a corrupt *file* (truncated gzip, broken zstd frame, unreadable parquet) raises
  :class:`CorruptInputError` naming the file, because nothing after the damage can be trusted.
"""

from __future__ import annotations

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


class CorruptInputError(RuntimeError):
    """An input file cannot be read past some point. The message names the file."""

    def __init__(self, path: str, cause: BaseException | str):
        self.path = path
        detail = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"corrupt input file {path}: {detail}")


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


def _corruption_errors() -> tuple[type[BaseException], ...]:
    errs: list[type[BaseException]] = [EOFError, zlib.error, gzip.BadGzipFile, OSError]
    try:
        import zstandard

        errs.append(zstandard.ZstdError)
    except ImportError:  # pragma: no cover
        pass
    try:
        import pyarrow

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
    index = 0
    for line in _iter_lines(f):
        if not line.strip():
            continue  # blank lines are not records
        try:
            s = line.decode("utf-8")
        except UnicodeDecodeError:
            yield Record(index, None, len(line), SKIP_INVALID_UTF8)
            index += 1
            continue
        try:
            obj = json.loads(s)
        except ValueError:
            yield Record(index, None, len(line), SKIP_INVALID_JSON)
            index += 1
            continue
        yield _check_text(index, obj.get(text_field) if isinstance(obj, dict) else None, max_doc_bytes)
        index += 1


def _iter_parquet(f, text_field: str, max_doc_bytes: int | None) -> Iterator[Record]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(f)
    if text_field not in pf.schema_arrow.names:
        for i in range(pf.metadata.num_rows):
            yield Record(i, None, 0, SKIP_MISSING_TEXT)
        return
    index = 0
    for batch in pf.iter_batches(batch_size=4096, columns=[text_field]):
        for value in batch.column(0).to_pylist():
            if isinstance(value, bytes):
                try:
                    value = value.decode("utf-8")
                except UnicodeDecodeError:
                    yield Record(index, None, len(value), SKIP_INVALID_UTF8)
                    index += 1
                    continue
            yield _check_text(index, value, max_doc_bytes)
            index += 1


def iter_documents(path: str, text_field: str = "text", max_doc_bytes: int | None = None) -> Iterator[Record]:
    """Yield every record of one file in order; raise :class:`CorruptInputError` if the file is damaged."""
    errors = _corruption_errors()
    try:
        with fsspec.open(path, "rb", compression="infer") as f:
            if ".parquet" in path.rsplit("/", 1)[-1]:
                yield from _iter_parquet(f, text_field, max_doc_bytes)
            else:
                yield from _iter_jsonl(f, text_field, max_doc_bytes)
    except FileNotFoundError:
        raise
    except errors as e:
        raise CorruptInputError(path, e) from e
