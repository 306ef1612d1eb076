"""Saving: each process stages its own shards in host memory, writes them (tensorstore), then its
part record; process 0 writes COMMIT once every part is there.

The outcome of a save is one decision, process 0's, which every process reads from the store: COMMIT,
or ABORT (with the reason) when process 0 gives the save up (a part did not arrive within the part
timeout, the store refused one of its own writes). The others wait for that verdict rather than each
deciding on a timeout of its own, and a process whose writes are still under way when the verdict
appears (a part the store holds) abandons them: saves are written one after another, so a process
that kept waiting would start its next save that much later, past process 0's part timeout for that
save too, and one slow write would fail every save after it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import fsspec
import numpy as np

from marin.execution.retry import StorageUnavailable, call_with_retry
from marin.training.checkpoint.format import (
    ABORT_FILE,
    ARRAYS_DIR,
    COMMIT_FILE,
    FORMAT,
    INDEX_FILE,
    PART_TIMEOUT_S,
    PARTS_DIR,
    CheckpointWriteError,
    chunk_shape,
    flatten_with_keys,
    kvstore_spec,
    one_line,
    part_name,
    process_and_count,
    stored_dtype,
)

logger = logging.getLogger(__name__)


def _array_spec(url: str, shape: tuple[int, ...], dtype: np.dtype, chunk: tuple[int, ...]) -> dict[str, Any]:
    return {
        "driver": "zarr3",
        "kvstore": kvstore_spec(url),
        # every chunk on storage, zeros too: a missing chunk is then always damage, never "fill value"
        "store_data_equal_to_fill_value": True,
        "metadata": {
            "shape": list(shape),
            "data_type": dtype.name,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [max(1, c) for c in chunk]}},
            # crc32c per chunk: a truncated or bit-flipped chunk fails to read instead of loading garbage
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
        },
    }


def _commit(fs: Any, path: str, data: bytes, *, retry: bool = True) -> None:
    """Single atomic write of a record: rename on local disk, one PUT on object stores (retried
    through a transient store outage by the executor's one retry policy, the PUT being idempotent;
    ``retry=False``: one try)."""
    from fsspec.implementations.local import LocalFileSystem  # object-store paths only

    if isinstance(fs, LocalFileSystem):
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        tmp = f"{path}.tmp"
        fs.pipe_file(tmp, data)
        fs.mv(tmp, path)
    elif retry:
        call_with_retry(lambda: fs.pipe_file(path, data), what=f"write {path}")
    else:
        fs.pipe_file(path, data)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Process 0's decision on one save, the same on every process: committed, or not and why."""

    committed: bool
    reason: str = ""


def read_verdict(commit: bool, abort: Mapping[str, Any] | None, save_try: int) -> Verdict | None:
    """The decision on try ``save_try`` of a save from what its directory shows: ``commit`` (COMMIT is
    there) and ``abort`` (process 0's ABORT record, None when there is none); None while undecided.

    COMMIT wins whichever try wrote it: every try of a step writes the same bytes, so a committed
    directory is that step's checkpoint. An ABORT counts only for its own try: a final save tried
    again finds the previous try's ABORT beside it, which says nothing about this one. Pure."""
    if commit:
        return Verdict(True)
    if abort is not None and abort.get("try") == save_try:
        return Verdict(False, str(abort.get("reason") or "no reason recorded"))
    return None


class _VerdictWatch:
    """Process 0's verdict on one save as the store shows it (:func:`read_verdict`)."""

    def __init__(self, fs: Any, root: str, save_try: int, every_s: float) -> None:
        self.fs, self.root, self.save_try, self.every_s = fs, root, save_try, every_s
        self._next = 0.0

    def look(self) -> Verdict | None:
        """One look at the store; a lookup that fails counts as "not decided yet"."""
        if hasattr(self.fs, "invalidate_cache"):
            self.fs.invalidate_cache(self.root)
        try:
            if self.fs.exists(f"{self.root}/{COMMIT_FILE}"):
                return read_verdict(True, None, self.save_try)
            abort = json.loads(self.fs.cat_file(f"{self.root}/{ABORT_FILE}"))
        except Exception:  # noqa: BLE001 - no ABORT (FileNotFoundError), or a store briefly out: look again
            return None
        return read_verdict(False, abort if isinstance(abort, dict) else None, self.save_try)

    def poll(self) -> Verdict | None:
        """:meth:`look`, at most once every ``every_s`` seconds (while this process writes its share)."""
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + self.every_s
        return self.look()

    def wait(self, timeout_s: float) -> Verdict:
        """Wait for the verdict: CheckpointWriteError when there is none within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        delay = 0.02
        while True:
            verdict = self.look()
            if verdict is not None:
                return verdict
            if time.monotonic() > deadline:
                raise CheckpointWriteError(f"{self.root}: no verdict from process 0 ({COMMIT_FILE} or {ABORT_FILE}) "
                                           f"within {timeout_s:.0f} s")
            time.sleep(delay)
            delay = min(self.every_s, delay * 2)


class _Abandoned(Exception):  # noqa: N818 - not an error: the verdict came first
    """Raised in a writer thread whose save's verdict came before its writes finished."""


def _until_verdict(fn: Callable[[], None], watch: _VerdictWatch, stop: threading.Event) -> Verdict | None:
    """Run ``fn`` (this process's writes) in a thread of its own while watching for the verdict: None
    once ``fn`` is done (its error raised), or the verdict if it comes first; then ``stop`` is set and
    the writes are abandoned (cancelled where they can be; a request already sent ends on its own)."""
    done, errors = threading.Event(), []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            errors.append(e)
        finally:
            done.set()

    threading.Thread(target=run, name="checkpoint-share", daemon=True).start()
    while not done.wait(watch.every_s):
        verdict = watch.poll()
        if verdict is not None:
            stop.set()
            return verdict
    if errors:
        raise errors[0]
    return None


@dataclasses.dataclass
class Staged:
    """One process's share of a save, in host memory: the leaf table and the shards it writes."""

    path: str
    step: int
    entries: list[dict[str, Any]]
    shards: list[tuple[int, tuple[slice, ...], np.ndarray]]  # (leaf number, global index, data)
    metadata: dict[str, Any]
    process: int
    num_processes: int
    save_try: int = 1  # the how-manieth save of this step in this attempt (a final save tried again: 2, 3, ...)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for _, _, a in self.shards)


def stage(path: str, tree: Any, metadata: Mapping[str, Any], *, step: int, save_try: int = 1) -> Staged:
    """Copy this process's shards of ``tree`` to host memory (blocking: the caller may donate the
    device buffers right after). Each shard is written by exactly one process: the one holding
    replica 0 of it; host numpy leaves are written by process 0."""
    keys, leaves, _ = flatten_with_keys(tree)
    return stage_leaves(path, keys, leaves, metadata, step=step, save_try=save_try)


def stage_leaves(path: str, keys: list[str], leaves: list[Any], metadata: Mapping[str, Any], *, step: int,
                 save_try: int = 1) -> Staged:
    """:func:`stage` of leaves already flattened, under the key paths ``keys``."""
    import jax  # not at the top: review and planning read checkpoint records without JAX

    process, count = process_and_count()
    for leaf in leaves:  # start every device-to-host copy before waiting on any
        if isinstance(leaf, jax.Array):
            for s in leaf.addressable_shards:
                if s.replica_id == 0:
                    s.data.copy_to_host_async()
    entries, shards = [], []
    for i, (key, leaf) in enumerate(zip(keys, leaves, strict=True)):
        shape = tuple(np.shape(leaf))
        if isinstance(leaf, jax.Array):
            dtype = np.dtype(leaf.dtype)
            chunk = chunk_shape(tuple(leaf.sharding.shard_shape(leaf.shape)), dtype.itemsize)
            for s in leaf.addressable_shards:
                if s.replica_id == 0:
                    host = np.asarray(s.data)
                    if s.device.platform == "cpu":
                        # a CPU device's buffer is host memory and np.asarray is a view of it: copy, so
                        # the next step may donate (overwrite) the buffer while this copy is written
                        host = host.copy()
                    shards.append((i, s.index, host))
        else:
            arr = np.asarray(leaf)
            chunk, dtype = chunk_shape(shape, arr.dtype.itemsize), arr.dtype
            if process == 0:
                shards.append((i, tuple(slice(None) for _ in shape), arr))
        entries.append({"key": key, "dtype": dtype.name, "shape": list(shape), "chunk": list(chunk),
                        "array": f"{ARRAYS_DIR}/leaf-{i:05d}"})
    return Staged(path, step, entries, shards, dict(metadata), process, count, save_try)


_WRITE_REQUEST_RETRIES = {"max_retries": 3, "initial_delay": "0.2s", "max_delay": "1s"}
"""tensorstore's own retries of one chunk request: a brief blip only. By default it keeps retrying for
many minutes, outside the one retry policy (its limit, its log lines); a longer outage reaches
:func:`call_with_retry` instead, which re-issues the writes (see :class:`_ShardWriter`)."""


@functools.cache
def _write_context() -> Any:
    """One tensorstore context for every save of this process (its connection pools are reused)."""
    import tensorstore as ts  # the train extra; records are read without it

    return ts.Context({"s3_request_retries": _WRITE_REQUEST_RETRIES, "gcs_request_retries": _WRITE_REQUEST_RETRIES})


class _ShardWriter:
    """One try of writing this process's staged shards; each call re-issues only the shards that
    have not landed yet, so a retry after an outage writes what is missing, not everything again."""

    def __init__(self, staged: Staged, ts: Any, stop: threading.Event | None = None) -> None:
        self.staged, self.ts, self.stop = staged, ts, stop
        self.opened: dict[int, Any] = {}
        self.done: set[int] = set()
        self.context = _write_context()

    def _array(self, leaf: int) -> Any:
        if leaf not in self.opened:
            e = self.staged.entries[leaf]
            spec = _array_spec(f"{self.staged.path}/{e['array']}", tuple(e["shape"]), stored_dtype(e["dtype"]),
                               tuple(e["chunk"]))
            # process 0 writes the array's metadata; the others write their chunks beside it
            self.opened[leaf] = (
                self.ts.open(spec, create=True, open=True, context=self.context).result()
                if self.staged.process == 0 else
                self.ts.open(spec, open=True, assume_metadata=True, context=self.context).result())
        return self.opened[leaf]

    def _stopped(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    def _await(self, future: Any) -> None:
        """``future.result()``; raises :class:`_Abandoned` once ``stop`` is set first."""
        while self.stop is not None and not future.done():
            if self.stop.wait(0.1):
                raise _Abandoned
        future.result()

    def __call__(self) -> None:
        if self._stopped():
            raise _Abandoned  # the verdict came during the retry policy's wait
        futures, first_error = [], None
        for n, (leaf, index_, data) in enumerate(self.staged.shards):
            if n in self.done:
                continue
            try:
                futures.append((n, self._array(leaf)[index_].write(data)))
            except Exception as e:  # noqa: BLE001 - classified by the caller's retry policy
                first_error = e
                break  # the writes already issued are still awaited below
        for n, f in futures:
            try:
                self._await(f.commit)
                self.done.add(n)
            except _Abandoned:
                for _, other in futures:
                    other.commit.cancel()
                raise
            except Exception as e:  # noqa: BLE001 - classified by the caller's retry policy
                first_error = first_error or e
        if first_error is not None:
            raise first_error


def write_staged(staged: Staged, *, part_timeout_s: float = PART_TIMEOUT_S, poll_s: float = 1.0) -> None:
    """Write one process's staged shards and its part record; process 0 then waits for every part and
    writes COMMIT, or ABORT when it gives the save up. The other processes end with that verdict,
    looking for it every ``poll_s`` seconds while they write (their unfinished writes are abandoned
    once it is there) and then for up to twice the part timeout. Any failure leaves the checkpoint
    uncommitted (raised as CheckpointWriteError)."""
    import tensorstore as ts  # the train extra; records are read without it

    fs, root = fsspec.core.url_to_fs(staged.path)
    try:
        if staged.process == 0:
            fs.makedirs(root, exist_ok=True)
            index = {"format": FORMAT, "step": staged.step, "leaves": staged.entries, "metadata": staged.metadata,
                     "processes": staged.num_processes}
            raw = json.dumps(index, indent=1, sort_keys=True).encode()
            call_with_retry(lambda: fs.pipe_file(f"{root}/{INDEX_FILE}", raw), what=f"write {root}/{INDEX_FILE}")
        part = json.dumps({"step": staged.step, "process": staged.process, "chunks": len(staged.shards),
                           "bytes": staged.nbytes, "time": time.time()}).encode()
        # the chunk writes are repeatable (same bytes under the same keys): an outage of the store is
        # ridden out by the one retry policy, which re-issues only the writes that did not land
        what = f"write the chunks of {staged.path} (process {staged.process})"
        if staged.process != 0:
            _write_share(staged, ts, fs, root, part, what, part_timeout_s, poll_s)
            return
        call_with_retry(_ShardWriter(staged, ts), what=what)
        _commit(fs, f"{root}/{PARTS_DIR}/{part_name(0)}", part)
        _wait_for_parts(fs, root, staged.num_processes, part_timeout_s)
        commit = {"format": FORMAT, "step": staged.step, "processes": staged.num_processes, "time": time.time()}
        _commit(fs, f"{root}/{COMMIT_FILE}", json.dumps(commit).encode())
    except CheckpointWriteError as e:
        if staged.process == 0:
            _abort(fs, root, staged, str(e))
        raise
    except Exception as e:  # noqa: BLE001 - storage errors come from several libraries; all mean "not saved"
        cause = str(e) if isinstance(e, StorageUnavailable) else one_line(e)  # the former: one line, cause last
        if staged.process == 0:
            _abort(fs, root, staged, cause)
        raise CheckpointWriteError(
            f"saving checkpoint {staged.path} failed on process {staged.process}: {cause}; it was not "
            "committed and the previous checkpoint is intact"
        ) from e


def _write_share(staged: Staged, ts: Any, fs: Any, root: str, part: bytes, what: str, part_timeout_s: float,
                 poll_s: float) -> None:
    """A process other than 0: its chunks, then its part record, then process 0's verdict. A verdict
    that comes while the writes are still under way (process 0 gave the save up without this part,
    or committed it from an earlier try's) ends them: this save's outcome is known, and the next save
    must not start late. Process 0 writes saves one after another and its previous one may have
    waited a whole part timeout, so it may decide this one that much later: twice the timeout."""
    part_path = f"{root}/{PARTS_DIR}/{part_name(staged.process)}"
    watch, stop = _VerdictWatch(fs, root, staged.save_try, poll_s), threading.Event()
    writer = _ShardWriter(staged, ts, stop)
    verdict = _until_verdict(lambda: call_with_retry(writer, what=what), watch, stop)
    if verdict is None:  # the part record's thread holds only the record, not the staged shards
        verdict = _until_verdict(lambda: _commit(fs, part_path, part), watch, stop)
    abandoned = verdict is not None
    if verdict is None:
        verdict = watch.wait(2 * part_timeout_s)
    if not verdict.committed:
        left = "; this process abandoned its unfinished writes" if abandoned else ""
        raise CheckpointWriteError(f"saving checkpoint {staged.path} failed on process {staged.process}: process 0 "
                                   f"gave it up ({verdict.reason}){left}; it was not committed and the previous "
                                   "checkpoint is intact")


def _abort(fs: Any, root: str, staged: Staged, reason: str) -> None:
    """Process 0's verdict that this try of the save failed, for the other processes to read (one try:
    a store that refuses it leaves them to their own timeout)."""
    record = {"step": staged.step, "try": staged.save_try, "reason": reason, "time": time.time()}
    try:
        _commit(fs, f"{root}/{ABORT_FILE}", json.dumps(record).encode(), retry=False)
    except Exception as e:  # noqa: BLE001 - every storage library's error means "not written"
        logger.warning("could not write the verdict %s/%s (%s): the other processes give the save up on their own "
                       "timeout", root, ABORT_FILE, one_line(e))


def _wait_for_parts(fs: Any, root: str, count: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = set(range(count))
    delay = 0.02
    while True:
        if hasattr(fs, "invalidate_cache"):
            fs.invalidate_cache(f"{root}/{PARTS_DIR}")
        pending = {p for p in pending if not call_with_retry(
            lambda p=p: fs.exists(f"{root}/{PARTS_DIR}/{part_name(p)}"), what=f"look up the parts of {root}")}
        if not pending:
            return
        if time.monotonic() > deadline:
            names = ", ".join(part_name(p) for p in sorted(pending))
            raise CheckpointWriteError(f"{root}: parts {names} did not arrive within {timeout_s:.0f} s; not committed")
        time.sleep(delay)
        delay = min(1.0, delay * 2)


def write_checkpoint(path: str, tree: Any, metadata: Mapping[str, Any], *, step: int, is_writer: bool = True) -> None:
    """Write ``tree`` and JSON-able ``metadata`` to directory ``path`` synchronously (every process of
    a pool calls it; each writes its own shards). ``is_writer`` is accepted for older callers: which
    process writes what follows from the arrays' shardings."""
    del is_writer
    write_staged(stage(path, tree, metadata, step=step))
