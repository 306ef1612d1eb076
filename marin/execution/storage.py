"""Small storage layer for the executor's bookkeeping files: local disk fast path, fsspec otherwise.

Guarantees by backend (see docs/architecture.md):

* local disk: whole-file writes are atomic (temp file + ``os.replace``); compare-and-swap holds a
  ``flock`` on the step directory, so it is exact between processes on one host (and on NFS setups
  where flock is honoured).
* S3 (``s3://``): single PUTs are atomic; compare-and-swap uses conditional writes
  (``If-None-Match: *`` to create, ``If-Match: <etag>`` to replace), so it is exact.
* GCS and other fsspec stores: single writes are atomic, but gcsfs exposes no generation-match for
  replacing an object, so compare-and-swap is check-then-write-then-verify: two racers can both
  believe they won for a moment; the loser finds out at its next heartbeat (see leases).

Every object-store call here goes through the one retry policy for transient errors
(:func:`retry.call_with_retry`): a store that is unreachable for a moment delays a bookkeeping write
instead of failing the step.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import glob as glob_module
import hashlib
import itertools
import json
import os
import shutil
import tempfile
import threading
from typing import Any, Iterator

from marin.execution.failures import DISK_FULL_ERRNOS
from marin.execution.retry import call_with_retry
from marin.textfmt import format_bytes


def is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def _local(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


@functools.lru_cache(maxsize=32)
def _fs_for(protocol_and_options: str) -> Any:
    import fsspec  # a run on local disk never loads fsspec and its object-store plugins

    return fsspec.filesystem(protocol_and_options)


def filesystem(path: str) -> Any:
    """The fsspec filesystem for a URL (cached per protocol; credentials come from the environment)."""
    protocol = path.split("://", 1)[0] if "://" in path else "file"
    return _fs_for(protocol)


def read_text(path: str) -> str | None:
    """Contents of ``path``, or None if it does not exist."""
    if is_local(path):
        try:
            with open(_local(path), encoding="utf-8") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None
    fs = filesystem(path)

    def cat() -> str | None:
        try:
            return fs.cat_file(path).decode("utf-8")
        except FileNotFoundError:
            return None

    return call_with_retry(cat, what=f"read {path}")


def read_json(path: str) -> Any:
    """The JSON document at ``path``, or None when it is missing, empty or not JSON (files here are
    written atomically, so unreadable JSON is foreign damage, read as absent)."""
    text = read_text(path)
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


_tmp_names = itertools.count()


def _temp_name(directory: str) -> str:
    """A temporary name in ``directory``, unique to this process and thread (leftovers of a crash
    start with ``.tmp-`` and are ignored by every reader)."""
    return f"{directory}/.tmp-{os.getpid()}-{threading.get_ident()}-{next(_tmp_names)}"


def _create_temp(directory: str) -> tuple[int, str]:
    """A new, exclusively created temporary file in ``directory``: ``(fd, path)``."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    while True:
        tmp = _temp_name(directory)
        try:
            return os.open(tmp, flags, 0o644), tmp
        except FileExistsError:  # a leftover of a dead process that had the same pid
            continue


def write_text(path: str, text: str, *, consume: str | None = None) -> None:
    """Replace ``path`` with ``text`` atomically (readers see the old or the new file, never half).

    ``consume``: a file in the same directory to remove with this write (the lease of a step whose
    SUCCESS this is). On local disk its inode becomes the new file: it is renamed away (removed, for
    every reader), rewritten under its temporary name and renamed onto ``path``, so the write creates
    no file; creating one is the dominant cost of a bookkeeping write on some filesystems (see
    docs/performance.md). A crash midway leaves ``path`` as it was and ``consume`` gone.

    A local write that finds the disk full spends the space a :func:`space_reserved` block holds on
    that filesystem, a slice at a time, and tries again: the record of why a step failed must not be
    lost to the very disk that made it fail."""
    if is_local(path):
        while True:
            try:
                _write_local(_local(path), text, consume)
                return
            except OSError as e:
                if e.errno not in DISK_FULL_ERRNOS or not _spend_reserve(os.path.dirname(_local(path)) or "."):
                    raise
                if consume is not None and not os.path.exists(_local(consume)):
                    consume = None  # renamed away by the failed try: its inode is gone with the temp file
    fs = filesystem(path)
    call_with_retry(lambda: fs.pipe_file(path, text.encode("utf-8")), what=f"write {path}")  # one PUT: atomic
    fs.invalidate_cache(path)
    if consume is not None:
        remove(consume)


def _write_local(p: str, text: str, consume: str | None) -> None:
    d = os.path.dirname(p) or "."
    fd = None
    if consume is not None:
        tmp = _temp_name(d)
        try:
            os.rename(_local(consume), tmp)
            fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = None
    if fd is None:
        try:  # the directory exists nearly always: create it only when needed (saves a syscall per write)
            fd, tmp = _create_temp(d)
        except FileNotFoundError:
            os.makedirs(d, exist_ok=True)
            fd, tmp = _create_temp(d)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8"))
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


# --------------------------------------------------------------------------------------------- #
# space held back for the records of a full disk                                                 #
# --------------------------------------------------------------------------------------------- #

RESERVE_BYTES = 1 << 20
"""Space a run holds back on its local prefix's filesystem (see :func:`space_reserved`): a status
record with its config and traceback is a few KiB, so this covers every record of a run's end
(failures, lease releases, the experiment record) with room to spare."""
_RESERVE_SLICE = 64 << 10


class _Reserve:
    def __init__(self, path: str, size: int, device: int) -> None:
        self.path, self.size, self.device = path, size, device


_reserves: list[_Reserve] = []
_reserves_lock = threading.Lock()
_sparing = threading.local()


@contextlib.contextmanager
def sparing_reserve() -> Iterator[None]:
    """Writes in this block (this thread) do not spend the reserve: for writes that may fail for a
    while without harm (a lease renewal: the lease outlives a few missed beats), so the space is
    left for the records that say why the step failed."""
    previous = getattr(_sparing, "on", False)
    _sparing.on = True
    try:
        yield
    finally:
        _sparing.on = previous


def _spend_reserve(directory: str) -> bool:
    """Free one slice of a reserve on ``directory``'s filesystem; False when none is left there (or
    inside :func:`sparing_reserve`)."""
    if getattr(_sparing, "on", False):
        return False
    try:
        device = os.stat(directory).st_dev
    except OSError:
        return False
    with _reserves_lock:
        for r in _reserves:
            if r.device == device and r.size > 0:
                r.size = max(0, r.size - _RESERVE_SLICE)
                with contextlib.suppress(OSError):
                    os.truncate(r.path, r.size)  # shrinking a file frees its blocks at once
                return True
    return False


@contextlib.contextmanager
def space_reserved(directory: str, nbytes: int = RESERVE_BYTES) -> Iterator[None]:
    """Hold ``nbytes`` of real disk blocks on ``directory``'s filesystem while the block runs (local
    disk only; object stores do not fill). :func:`write_text` spends them when the disk is full, so
    a run that fills its disk can still write why. The reserve is a hidden ``.tmp-reserve-*`` file,
    removed at the end (a crash leaves it, ignored by every reader like any ``.tmp-`` file)."""
    if not is_local(directory):
        yield
        return
    d = _local(directory)
    path = f"{d}/.tmp-reserve-{os.getpid()}-{next(_tmp_names)}"
    reserve = None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                if e.errno in DISK_FULL_ERRNOS:
                    raise
                os.write(fd, bytes(nbytes))  # a filesystem without fallocate: real blocks all the same
                os.fsync(fd)
        finally:
            os.close(fd)
        reserve = _Reserve(path, nbytes, os.stat(d).st_dev)
    except OSError:  # already full (or not writable): nothing to hold back; writes fail as they would
        with contextlib.suppress(OSError):
            os.unlink(path)
    if reserve is not None:
        with _reserves_lock:
            _reserves.append(reserve)
    try:
        yield
    finally:
        if reserve is not None:
            with _reserves_lock:
                _reserves.remove(reserve)
            with contextlib.suppress(OSError):
                os.unlink(path)


def remove(path: str) -> None:
    """Delete the file at ``path``; a missing file is not an error."""
    if is_local(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_local(path))
        return
    fs = filesystem(path)

    def rm() -> None:
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(path)

    call_with_retry(rm, what=f"remove {path}")
    fs.invalidate_cache(path)


def exists(path: str) -> bool:
    if is_local(path):
        return os.path.exists(_local(path))
    return call_with_retry(lambda: filesystem(path).exists(path), what=f"look up {path}")


def makedirs(path: str) -> None:
    if is_local(path):
        os.makedirs(_local(path), exist_ok=True)
    # object stores have no directories


def writable_problem(directory: str) -> str | None:
    """Why files cannot be created in ``directory`` (creating it if needed), or None if they can;
    a local disk with less free space than a run holds back (:data:`RESERVE_BYTES`) counts as full.

    Checked for real (create and remove a probe file) on local disk, because permission bits do not
    tell the whole story (read-only mounts, a regular file where a directory should be, root). On an
    object store a probe object is written and removed too, so a missing bucket or a read-only
    credential is found here, before Ray starts, not by a step's first write."""
    if not is_local(directory):
        probe = f"{directory.rstrip('/')}/.write-probe-{os.getpid()}-{next(_tmp_names)}"
        try:
            write_text(probe, "")
            remove(probe)
        except Exception as e:  # the store's own words: NoSuchBucket, AccessDenied, unreachable, ...
            bucket = directory.split("://", 1)[1].split("/", 1)[0]
            if isinstance(e, FileNotFoundError):
                return f"the bucket {bucket!r} does not exist or is not visible with these credentials"
            return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        return None
    d = _local(directory)
    probe = None
    try:
        os.makedirs(d, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=d)
        try:  # a block of data, not an empty file: a full disk still creates empty files
            os.write(fd, bytes(4096))
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        if e.errno in DISK_FULL_ERRNOS:
            usage = shutil.disk_usage(d)
            return f"the disk is full: {format_bytes(usage.free)} free of {format_bytes(usage.total)} on {d}"
        return f"{e.strerror or type(e).__name__}: {e.filename or d}"
    finally:
        if probe is not None:
            with contextlib.suppress(OSError):
                os.unlink(probe)
    usage = shutil.disk_usage(d)
    if usage.free < RESERVE_BYTES:  # the first lease or record write would find the disk full, with nothing held back
        return (f"the disk is nearly full: {format_bytes(usage.free)} free of {format_bytes(usage.total)} on {d}, "
                f"less than the {format_bytes(RESERVE_BYTES)} a run holds back for its steps' records")
    return None


def list_dir(path: str) -> list[str]:
    """Full paths of the entries directly under ``path`` (empty if it does not exist)."""
    if is_local(path):
        p = _local(path)
        try:
            return [os.path.join(p, n) for n in sorted(os.listdir(p))]
        except FileNotFoundError:
            return []
    fs = filesystem(path)

    def ls() -> list[str]:
        try:
            fs.invalidate_cache(path)
            return fs.ls(path, detail=False)
        except FileNotFoundError:
            return []

    entries = call_with_retry(ls, what=f"list {path}")
    proto = path.split("://", 1)[0]
    return sorted(e if "://" in e else f"{proto}://{e}" for e in entries)


def glob(pattern: str) -> list[str]:
    if is_local(pattern):
        return sorted(glob_module.glob(_local(pattern)))
    fs = filesystem(pattern)
    proto = pattern.split("://", 1)[0]
    found = call_with_retry(lambda: fs.glob(pattern), what=f"list {pattern}")
    return sorted(e if "://" in e else f"{proto}://{e}" for e in found)


# --------------------------------------------------------------------------------------------- #
# compare-and-swap                                                                               #
# --------------------------------------------------------------------------------------------- #


@contextlib.contextmanager
def _dir_lock(directory: str) -> Iterator[None]:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except FileNotFoundError:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


@contextlib.contextmanager
def step_lock(directory: str) -> Iterator[None]:
    """Exclusive section on one step directory, shared with :func:`compare_and_swap` there.

    On local disk this is the directory's ``flock``, so a check of the lease and the writes that
    depend on it cannot interleave with another process's compare-and-swap of that lease; object
    stores have no lock (their compare-and-swap is conditional writes, see the module docstring).
    Not re-entrant: inside it, call :func:`compare_and_swap` with ``locked=True``."""
    if is_local(directory):
        with _dir_lock(_local(directory)):
            yield
    else:
        yield


def read_with_tag(path: str) -> tuple[str | None, str | None]:
    """Contents and a version tag to pass to :func:`compare_and_swap` (None, None if missing)."""
    if path.startswith("s3://"):
        fs = filesystem(path)

        def read() -> tuple[str | None, str | None]:
            for _ in range(5):
                try:
                    fs.invalidate_cache(path)
                    etag = fs.info(path)["ETag"].strip('"')
                    data = fs.cat_file(path)
                except FileNotFoundError:
                    return None, None
                if hashlib.md5(data).hexdigest() == etag:  # simple PUT etag = md5 of the body
                    return data.decode("utf-8"), etag
            raise RuntimeError(f"{path} kept changing while being read")

        return call_with_retry(read, what=f"read {path}")
    text = read_text(path)
    return text, text


def compare_and_swap(path: str, text: str, expected_tag: str | None, *, locked: bool = False) -> bool:
    """Write ``text`` to ``path`` only if it is still at ``expected_tag`` (None: only if absent).

    Returns True if this call's write won. ``locked``: the caller already holds :func:`step_lock` on
    the file's directory.
    """
    if is_local(path):
        p = _local(path)
        with contextlib.nullcontext() if locked else _dir_lock(os.path.dirname(p)):
            current = read_text(p)
            if current != expected_tag:
                return False
            write_text(p, text)
            return True
    fs = filesystem(path)
    if path.startswith("s3://"):
        cond = {"mode": "create"} if expected_tag is None else {"IfMatch": expected_tag}
        try:  # a retried PUT that had landed before its connection broke loses its own race: callers
            # that care re-read and compare (see lease.renew)
            call_with_retry(lambda: fs.pipe_file(path, text.encode("utf-8"), **cond), what=f"write {path}")
        except Exception as e:  # s3fs maps 412 (and 404: If-Match on a removed file) to OSError flavours
            text = str(e).lower()
            lost = isinstance(e, (FileExistsError, FileNotFoundError))
            if lost or any(k in text for k in ("412", "precondition", "pre-condition")):
                return False
            raise
        finally:
            fs.invalidate_cache(path)
        return True
    # best effort: check, write, verify
    current = read_text(path)
    if current != expected_tag:
        return False
    write_text(path, text)
    return read_text(path) == text
