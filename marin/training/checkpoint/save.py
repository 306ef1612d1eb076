"""Saving: each process stages its own shards in host memory, writes them (tensorstore), then its
part record; process 0 writes COMMIT once every part is there.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Mapping
from typing import Any

import fsspec
import numpy as np

from marin.execution.retry import StorageUnavailable, call_with_retry
from marin.training.checkpoint.format import (
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


def _commit(fs: Any, path: str, data: bytes) -> None:
    """Single atomic write of a record: rename on local disk, one PUT on object stores (retried
    through a transient store outage by the executor's one retry policy; the PUT is idempotent)."""
    from fsspec.implementations.local import LocalFileSystem  # object-store paths only

    if isinstance(fs, LocalFileSystem):
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        tmp = f"{path}.tmp"
        fs.pipe_file(tmp, data)
        fs.mv(tmp, path)
    else:
        call_with_retry(lambda: fs.pipe_file(path, data), what=f"write {path}")


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

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for _, _, a in self.shards)


def stage(path: str, tree: Any, metadata: Mapping[str, Any], *, step: int) -> Staged:
    """Copy this process's shards of ``tree`` to host memory (blocking: the caller may donate the
    device buffers right after). Each shard is written by exactly one process: the one holding
    replica 0 of it; host numpy leaves are written by process 0."""
    keys, leaves, _ = flatten_with_keys(tree)
    return stage_leaves(path, keys, leaves, metadata, step=step)


def stage_leaves(path: str, keys: list[str], leaves: list[Any], metadata: Mapping[str, Any], *, step: int) -> Staged:
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
    return Staged(path, step, entries, shards, dict(metadata), process, count)


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

    def __init__(self, staged: Staged, ts: Any) -> None:
        self.staged, self.ts = staged, ts
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

    def __call__(self) -> None:
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
                f.commit.result()
                self.done.add(n)
            except Exception as e:  # noqa: BLE001 - classified by the caller's retry policy
                first_error = first_error or e
        if first_error is not None:
            raise first_error


def write_staged(staged: Staged, *, part_timeout_s: float = PART_TIMEOUT_S) -> None:
    """Write one process's staged shards and its part record; process 0 then waits for every part
    and writes COMMIT. Any failure leaves the checkpoint uncommitted (raised as CheckpointWriteError)."""
    import tensorstore as ts  # the train extra; records are read without it

    fs, root = fsspec.core.url_to_fs(staged.path)
    try:
        if staged.process == 0:
            fs.makedirs(root, exist_ok=True)
            index = {"format": FORMAT, "step": staged.step, "leaves": staged.entries, "metadata": staged.metadata,
                     "processes": staged.num_processes}
            raw = json.dumps(index, indent=1, sort_keys=True).encode()
            call_with_retry(lambda: fs.pipe_file(f"{root}/{INDEX_FILE}", raw), what=f"write {root}/{INDEX_FILE}")
        # the chunk writes are repeatable (same bytes under the same keys): an outage of the store is
        # ridden out by the one retry policy, which re-issues only the writes that did not land
        call_with_retry(_ShardWriter(staged, ts), what=f"write the chunks of {staged.path} (process {staged.process})")
        part = {"step": staged.step, "process": staged.process, "chunks": len(staged.shards),
                "bytes": staged.nbytes, "time": time.time()}
        _commit(fs, f"{root}/{PARTS_DIR}/{part_name(staged.process)}", json.dumps(part).encode())
        if staged.process != 0:
            # the save is done for this process only once it counts: when process 0 has committed it.
            # Process 0 writes saves one after another and its previous one may have waited a whole part
            # timeout for a part that never came, so it may start this one that much later: twice the timeout
            _wait_for_file(fs, f"{root}/{COMMIT_FILE}", 2 * part_timeout_s, "COMMIT (written by process 0)")
            return
        _wait_for_parts(fs, root, staged.num_processes, part_timeout_s)
        commit = {"format": FORMAT, "step": staged.step, "processes": staged.num_processes, "time": time.time()}
        _commit(fs, f"{root}/{COMMIT_FILE}", json.dumps(commit).encode())
    except CheckpointWriteError:
        raise
    except Exception as e:  # noqa: BLE001 - storage errors come from several libraries; all mean "not saved"
        cause = str(e) if isinstance(e, StorageUnavailable) else one_line(e)  # the former: one line, cause last
        raise CheckpointWriteError(
            f"saving checkpoint {staged.path} failed on process {staged.process}: {cause}; it was not "
            "committed and the previous checkpoint is intact"
        ) from e


def _wait_for_file(fs: Any, path: str, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    delay = 0.02
    while True:
        if hasattr(fs, "invalidate_cache"):
            fs.invalidate_cache(path.rsplit("/", 1)[0])
        if call_with_retry(lambda: fs.exists(path), what=f"look up {path}"):
            return
        if time.monotonic() > deadline:
            raise CheckpointWriteError(f"{path.rsplit('/', 1)[0]}: {what} did not appear within {timeout_s:.0f} s")
        time.sleep(delay)
        delay = min(1.0, delay * 2)


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
