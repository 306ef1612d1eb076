"""Sharded, asynchronous, atomic checkpoints of a training state, written by every process in parallel.

Layout under a step's output directory::

    checkpoints/step-00000100/index.json              process 0: every leaf's key path, dtype, shape and
                                                      array directory, plus the caller's metadata
    checkpoints/step-00000100/arrays/leaf-00007/      one zarr v3 array per leaf (tensorstore); its chunks
                                                      are the leaf's shards, each with a crc32c
    checkpoints/step-00000100/parts/process-00001.json  one per process, once all of its chunks are
                                                      durable: what it wrote (chunks, bytes)
    checkpoints/step-00000100/COMMIT                  process 0, last, once every part is there

Why it is built this way:

* **No process holds the whole state.** Each process writes only the shards its own devices hold
  (one replica of each: ``shard.replica_id == 0``), and a restore reads only the slices its devices
  need for the *target* sharding, so a checkpoint saved on one mesh restores onto any other (another
  pool, fewer devices, a single process for evaluation). The hero's state is about 6.4 TB; a host of
  a GB200 NVL72 rack has about 960 GB, and writes from 176 hosts proceed in parallel.
* **Async, one save in flight.** :meth:`CheckpointManager.save` copies this process's shards to host
  memory (the only part that blocks the training loop: the next step donates the state's buffers)
  and hands the writes to a background thread; a new save first waits for the previous one.
* **A checkpoint counts only when every part is committed.** A single small PUT is atomic on every
  store (object stores have no atomic rename), so COMMIT, written by process 0 after it has seen every
  process's part record, marks a complete checkpoint. A process killed in the middle of a save never
  writes its part, COMMIT never appears, readers ignore the directory and retention deletes it.
  Deletion removes COMMIT first for the same reason.
* **Storage through tensorstore's kvstore drivers** (``file``, ``s3``, ``gcs``): the same library
  orbax-checkpoint writes arrays with (Levanter uses it directly, as here). orbax's own path handling
  does not accept ``s3://`` URLs and its commit protocol differs per backend; one explicit protocol on
  all three stores is easier to reason about and to test. Small records (index, parts, COMMIT) go
  through fsspec.

Checkpoints of the earlier single-blob format (``arrays.bin`` + ``index.json`` + a COMMIT holding a
sha256) still restore, through the same entry points; ``marin convert-checkpoints
RUN_DIR`` rewrites them in this format.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import re
import time
from collections.abc import Mapping
from typing import Any

import fsspec
import numpy as np

from marin.execution.jsonable import from_jsonable
from marin.execution.retry import StorageUnavailable, call_with_retry

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
FORMAT = "zarr3-sharded-v1"
_STEP_RE = re.compile(r"^step-(\d{8,})$")
_INDEX = "index.json"
_COMMIT = "COMMIT"
_ARRAYS_DIR = "arrays"
_PARTS_DIR = "parts"
_LEGACY_ARRAYS = "arrays.bin"
PART_TIMEOUT_S = 3600.0  # how long process 0 waits for the other processes' parts before giving up
CHUNK_BYTES = 16 << 20
"""Target size of one stored chunk. A shard larger than this is split along its leading axis (the
layer axis of the stacked blocks), so a reader that wants one layer's slice (``marin export``)
decodes about one layer of one shard, not every layer of it."""


class CorruptCheckpointError(OSError):
    """A committed checkpoint whose data does not verify: a process part missing, a chunk truncated or
    failing its checksum, a lost file."""


class CheckpointMismatchError(ValueError):
    """A checkpoint whose leaves do not fit the state being restored: the model's structure (or the
    optimizer's) differs from the one that wrote it."""


class CheckpointWriteError(OSError):
    """A save failed (storage full, permissions, a lost connection); nothing of it counts as a
    checkpoint and the previous one is intact."""


@dataclasses.dataclass(frozen=True)
class CheckpointPolicy:
    """When to save and what to keep.

    Saves happen every ``every_steps`` steps and additionally whenever ``every_minutes`` of wall time
    passed since the last save (so a slow run still loses little work). The newest ``keep_last``
    checkpoints are kept; checkpoints at multiples of ``keep_every`` are permanent (for evaluation and
    for branching, e.g. the early-cooldown side branch). The final step is always saved.

    The second tier: with ``temp_every_minutes`` (and a temporary store given to the manager), a
    rolling temporary checkpoint is written whenever that much wall time passed since the last save of
    either tier. One is kept; it is deleted once a newer permanent one commits. This is how the
    published hero run checkpoints: permanent ones to the durable root, sparse, and a temporary one
    every hour to region-local storage, so a fault costs at most an hour
    (marin-community/marin, ``experiments/grug/moe_hero_ep/README.md``).
    """

    every_steps: int = 100
    every_minutes: float | None = None
    keep_last: int = 2
    keep_every: int | None = None
    temp_every_minutes: float | None = None

    def __post_init__(self) -> None:
        if self.every_steps <= 0:
            raise ValueError(f"every_steps must be > 0, got {self.every_steps}")
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {self.keep_last}")
        if self.keep_every is not None and self.keep_every <= 0:
            raise ValueError(f"keep_every must be > 0, got {self.keep_every}")
        if self.temp_every_minutes is not None and self.temp_every_minutes <= 0:
            raise ValueError(f"temp_checkpoint_every_minutes must be > 0, got {self.temp_every_minutes}")


PERMANENT = "permanent"
TEMPORARY = "temporary"


def temp_checkpoint_root(temp_prefix: str, output_path: str) -> str:
    """Where a run's temporary checkpoints go under the fast store ``temp_prefix``: a directory named
    after the run's own (its step name and version hash) plus a hash of its whole output path, so two
    runs of the same step under different prefixes never share (or delete) each other's."""
    run_dir = output_path.rstrip("/").rsplit("/", 1)[-1]
    where = hashlib.sha256(output_path.rstrip("/").encode()).hexdigest()[:8]
    return f"{temp_prefix.rstrip('/')}/{run_dir}-{where}/{CHECKPOINT_DIR}"


def step_dirname(step: int) -> str:
    return f"step-{step:08d}"


def flatten_with_keys(tree: Any) -> tuple[list[str], list[Any], Any]:
    """``(key paths, leaves, treedef)``: leaves are matched to checkpoint entries by key path."""
    import jax  # not at the top: review and planning read checkpoint records without JAX

    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    keys = [jax.tree_util.keystr(path) for path, _ in leaves_with_path]
    return keys, [leaf for _, leaf in leaves_with_path], treedef


def _dtype(name: str) -> np.dtype:
    import ml_dtypes  # registers bfloat16 and friends with numpy

    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


def chunk_shape(shard_shape: tuple[int, ...], itemsize: int, target_bytes: int | None = None) -> tuple[int, ...]:
    """The stored chunk of a shard: the shard itself, or, when it is larger than ``target_bytes``
    (default :data:`CHUNK_BYTES`), its leading axis cut to the largest divisor of that axis that keeps
    a chunk within the target (at least one row). A divisor, so chunks never straddle two shards:
    each chunk is written by exactly one process. Pure."""
    target = CHUNK_BYTES if target_bytes is None else target_bytes
    if not shard_shape or math.prod(shard_shape) * itemsize <= target:
        return tuple(shard_shape)
    lead = shard_shape[0]
    row = math.prod(shard_shape[1:]) * itemsize
    rows = max(1, target // max(1, row))
    best = max(d for d in range(1, min(lead, rows) + 1) if lead % d == 0)
    return (best, *shard_shape[1:])


def _process() -> tuple[int, int]:
    import jax  # not at the top: review and planning read checkpoint records without JAX

    return jax.process_index(), jax.process_count()


# ---- storage ---------------------------------------------------------------------------------------
def kvstore_spec(url: str) -> dict[str, Any]:
    """The tensorstore kvstore spec of a directory URL (local path, ``s3://``, ``gs://``).

    Endpoints come from the same environment the rest of the storage code uses: ``AWS_ENDPOINT_URL_S3``
    / ``AWS_ENDPOINT_URL`` for S3-compatible servers, ``STORAGE_EMULATOR_HOST`` for a GCS emulator.
    """
    path = url.rstrip("/") + "/"
    if path.startswith("s3://"):
        bucket, _, key = path[5:].partition("/")
        spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": key}
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            spec["endpoint"] = endpoint
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            spec["aws_region"] = region
        return spec
    if path.startswith(("gs://", "gcs://")):
        bucket, _, key = path.split("://", 1)[1].partition("/")
        spec = {"driver": "gcs", "bucket": bucket, "path": key}
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        if emulator:
            os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", emulator)  # tensorstore's own setting
        return spec
    if "://" in path and not path.startswith("file://"):
        raise ValueError(f"checkpoints support local paths, s3:// and gs://, not {url!r}")
    return {"driver": "file", "path": path.removeprefix("file://")}


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


def _part_name(process: int) -> str:
    return f"process-{process:05d}.json"


# ---- saving ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Staged:
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


def stage(path: str, tree: Any, metadata: Mapping[str, Any], *, step: int) -> _Staged:
    """Copy this process's shards of ``tree`` to host memory (blocking: the caller may donate the
    device buffers right after). Each shard is written by exactly one process: the one holding
    replica 0 of it; host numpy leaves are written by process 0."""
    keys, leaves, _ = flatten_with_keys(tree)
    return stage_leaves(path, keys, leaves, metadata, step=step)


def stage_leaves(path: str, keys: list[str], leaves: list[Any], metadata: Mapping[str, Any], *, step: int) -> _Staged:
    """:func:`stage` of leaves already flattened, under the key paths ``keys``."""
    import jax  # not at the top: review and planning read checkpoint records without JAX

    process, count = _process()
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
                        "array": f"{_ARRAYS_DIR}/leaf-{i:05d}"})
    return _Staged(path, step, entries, shards, dict(metadata), process, count)


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

    def __init__(self, staged: _Staged, ts: Any) -> None:
        self.staged, self.ts = staged, ts
        self.opened: dict[int, Any] = {}
        self.done: set[int] = set()
        self.context = _write_context()

    def _array(self, leaf: int) -> Any:
        if leaf not in self.opened:
            e = self.staged.entries[leaf]
            spec = _array_spec(f"{self.staged.path}/{e['array']}", tuple(e["shape"]), _dtype(e["dtype"]),
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


def write_staged(staged: _Staged, *, part_timeout_s: float = PART_TIMEOUT_S) -> None:
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
            call_with_retry(lambda: fs.pipe_file(f"{root}/{_INDEX}", raw), what=f"write {root}/{_INDEX}")
        # the chunk writes are repeatable (same bytes under the same keys): an outage of the store is
        # ridden out by the one retry policy, which re-issues only the writes that did not land
        call_with_retry(_ShardWriter(staged, ts), what=f"write the chunks of {staged.path} (process {staged.process})")
        part = {"step": staged.step, "process": staged.process, "chunks": len(staged.shards),
                "bytes": staged.nbytes, "time": time.time()}
        _commit(fs, f"{root}/{_PARTS_DIR}/{_part_name(staged.process)}", json.dumps(part).encode())
        if staged.process != 0:
            # the save is done for this process only once it counts: when process 0 has committed it
            _wait_for_file(fs, f"{root}/{_COMMIT}", part_timeout_s, "COMMIT (written by process 0)")
            return
        _wait_for_parts(fs, root, staged.num_processes, part_timeout_s)
        commit = {"format": FORMAT, "step": staged.step, "processes": staged.num_processes, "time": time.time()}
        _commit(fs, f"{root}/{_COMMIT}", json.dumps(commit).encode())
    except CheckpointWriteError:
        raise
    except Exception as e:  # noqa: BLE001 - storage errors come from several libraries; all mean "not saved"
        cause = str(e) if isinstance(e, StorageUnavailable) else _one_line(e)  # the former: one line, cause last
        raise CheckpointWriteError(
            f"saving checkpoint {staged.path} failed on process {staged.process}: {cause}; it was not "
            "committed and the previous checkpoint is intact"
        ) from e


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text if len(text) < 300 else text[:300] + "..."


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
            fs.invalidate_cache(f"{root}/{_PARTS_DIR}")
        pending = {p for p in pending if not call_with_retry(
            lambda p=p: fs.exists(f"{root}/{_PARTS_DIR}/{_part_name(p)}"), what=f"look up the parts of {root}")}
        if not pending:
            return
        if time.monotonic() > deadline:
            names = ", ".join(_part_name(p) for p in sorted(pending))
            raise CheckpointWriteError(f"{root}: parts {names} did not arrive within {timeout_s:.0f} s; not committed")
        time.sleep(delay)
        delay = min(1.0, delay * 2)


def write_checkpoint(path: str, tree: Any, metadata: Mapping[str, Any], *, step: int, is_writer: bool = True) -> None:
    """Write ``tree`` and JSON-able ``metadata`` to directory ``path`` synchronously (every process of
    a pool calls it; each writes its own shards). ``is_writer`` is accepted for older callers: which
    process writes what follows from the arrays' shardings."""
    del is_writer
    write_staged(stage(path, tree, metadata, step=step))


# ---- reading ---------------------------------------------------------------------------------------
def read_commit(path: str) -> dict[str, Any] | None:
    """The COMMIT record of checkpoint directory ``path``, or None if it is not complete."""
    fs, root = fsspec.core.url_to_fs(path)
    try:
        commit = json.loads(fs.cat_file(f"{root}/{_COMMIT}"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return commit if isinstance(commit, dict) and ("format" in commit or "sha256" in commit) else None


def is_legacy(commit: Mapping[str, Any]) -> bool:
    """Whether a COMMIT record is of the earlier single-blob format."""
    return "sha256" in commit and "format" not in commit


def read_index(path: str) -> dict[str, Any]:
    fs, root = fsspec.core.url_to_fs(path)
    try:
        return json.loads(fs.cat_file(f"{root}/{_INDEX}"))
    except (FileNotFoundError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"{path}: {_INDEX} is missing or unreadable ({type(e).__name__})") from None


def read_metadata(path: str) -> dict[str, Any]:
    """The caller metadata of a committed checkpoint (config, step, tokens, data position), without
    reading its arrays."""
    if read_commit(path) is None:
        raise FileNotFoundError(f"{path} is not a committed checkpoint (no valid {_COMMIT})")
    return read_index(path)["metadata"]


def latest_checkpoint(output_path: str) -> str | None:
    """Path of the newest committed checkpoint of a training step's output directory, or None."""
    mgr = CheckpointManager(output_path, CheckpointPolicy())
    step = mgr.latest_step()
    return None if step is None else mgr.path_for(step)


def _describe(dtype: Any, shape: Any) -> str:
    return f"{np.dtype(dtype).name}{list(shape)}"


def check_template(path: str, entries: list[dict[str, Any]], template: Any, *, partial: bool = False) -> None:
    """Raise :class:`CheckpointMismatchError` naming every leaf whose presence, shape or dtype differs
    between the checkpoint's index and ``template`` (arrays or ``jax.ShapeDtypeStruct``s), before any
    array is read. ``partial``: the checkpoint may hold more leaves than the template (a model read
    without its optimizer state)."""
    keys, leaves, _ = flatten_with_keys(template)
    saved = {e["key"]: e for e in entries}
    wanted = dict(zip(keys, leaves, strict=True))
    problems = []
    for k, leaf in wanted.items():
        want = _describe(leaf.dtype, np.shape(leaf) if not hasattr(leaf, "shape") else leaf.shape)
        if k not in saved:
            problems.append(f"{k}: missing from the checkpoint (model wants {want})")
            continue
        have = _describe(_dtype(saved[k]["dtype"]), saved[k]["shape"])
        if have != want:
            problems.append(f"{k}: checkpoint {have}, model wants {want}")
    if not partial:
        problems += [f"{k}: in the checkpoint ({_describe(_dtype(e['dtype']), e['shape'])}) but not in the model"
                     for k, e in saved.items() if k not in wanted]
    if problems:
        # parameters first: optimizer moments mirror them and only repeat the story
        problems.sort(key=lambda p: not p.startswith("['params']"))
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise CheckpointMismatchError(
            f"checkpoint {path} does not match the model being trained ({len(problems)} of {len(wanted)} leaves "
            f"differ): {shown}. It was written by a different model configuration; train into a new output "
            "path (change a versioned field) or remove its checkpoints/ directory to start over"
        )


def verify_parts(path: str, commit: Mapping[str, Any]) -> None:
    """Every process's part record is there and belongs to this step; else CorruptCheckpointError
    naming the missing part (a lost file, a copy that stopped half way)."""
    fs, root = fsspec.core.url_to_fs(path)
    count = int(commit.get("processes", 1))
    for p in range(count):
        try:
            part = json.loads(fs.cat_file(f"{root}/{_PARTS_DIR}/{_part_name(p)}"))
        except (FileNotFoundError, json.JSONDecodeError) as e:
            raise CorruptCheckpointError(
                f"{path}: part {_PARTS_DIR}/{_part_name(p)} (process {p} of {count}) is missing or unreadable "
                f"({type(e).__name__})") from None
        if part.get("step") != commit.get("step"):
            raise CorruptCheckpointError(f"{path}: part {_part_name(p)} is of step {part.get('step')}, "
                                         f"not {commit.get('step')}")


READ_AHEAD_BYTES = 512 << 20  # reads in flight ahead of the leaf being placed, per process


def _read_leaves(path: str, entries: list[dict[str, Any]], wanted: list[str], shardings: list[Any] | None) -> list[Any]:
    """Read the ``wanted`` leaves: as global jax Arrays laid out by ``shardings`` (each process reads
    only the slices its own devices hold), or, with ``shardings=None``, whole, as numpy arrays in this
    process. Reads run concurrently up to :data:`READ_AHEAD_BYTES` ahead of the leaf being placed, so
    host memory holds the restored state plus one window, not two copies of it."""
    import jax  # not at the top: review and planning read checkpoint records without JAX
    import tensorstore as ts  # the train extra; records are read without it

    by_key = {e["key"]: e for e in entries}

    def issue(n: int) -> tuple[dict[Any, Any], int]:
        key = wanted[n]
        e = by_key[key]
        spec = {"driver": "zarr3", "kvstore": kvstore_spec(f"{path}/{e['array']}"), "fill_missing_data_reads": False}
        try:
            t = ts.open(spec, open=True, read=True).result()
        except Exception as err:  # noqa: BLE001 - tensorstore raises ValueError for every storage error
            raise CorruptCheckpointError(f"{path}: {key} cannot be opened: {_one_line(err)}") from None
        shape = tuple(e["shape"])
        if shardings is None:
            return {(): t.read()}, math.prod(shape) * _dtype(e["dtype"]).itemsize
        uniq: dict[Any, Any] = {}
        for idx in shardings[n].addressable_devices_indices_map(shape).values():
            k = _index_key(idx, shape)
            if k not in uniq:
                uniq[k] = t[idx].read() if shape else t.read()
        nbytes = sum(math.prod(b - a for a, b in k) for k in uniq) * _dtype(e["dtype"]).itemsize
        return uniq, nbytes

    pending: dict[int, tuple[dict[Any, Any], int]] = {}
    in_flight = 0
    issued = 0
    out = []
    for n, key in enumerate(wanted):
        while issued < len(wanted) and (issued <= n or in_flight < READ_AHEAD_BYTES):
            pending[issued] = issue(issued)
            in_flight += pending[issued][1]
            issued += 1
        reads, nbytes = pending.pop(n)
        try:
            done = {k: np.asarray(f.result()) for k, f in reads.items()}
        except Exception as err:  # noqa: BLE001
            raise CorruptCheckpointError(f"{path}: {key} does not read back: {_one_line(err)}") from None
        del reads
        in_flight -= nbytes
        shape = tuple(by_key[key]["shape"])
        if shardings is None:
            out.append(done[()])
            continue
        s = shardings[n]
        arrays = [jax.device_put(done[_index_key(idx, shape)], d)
                  for d, idx in s.addressable_devices_indices_map(shape).items()]
        out.append(jax.make_array_from_single_device_arrays(shape, s, arrays))
        del done, arrays
    return out


class LeafReader:
    """A stored leaf read lazily, slice by slice, without JAX: indexing narrows the view
    (``reader[3][..., :36]``) and ``np.asarray(reader)`` reads only the chunks under it (each chunk's
    checksum verified; damage raises :class:`CorruptCheckpointError`). What ``marin export`` reads a
    checkpoint with, so its host memory is one slice, not one leaf."""

    def __init__(self, path: str, key: str, view: Any) -> None:
        self.path, self.key, self.view = path, key, view

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.view.shape)

    def __getitem__(self, index: Any) -> LeafReader:
        return LeafReader(self.path, self.key, self.view[index])

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        try:
            out = np.asarray(self.view.read().result())
        except Exception as err:  # noqa: BLE001 - tensorstore raises ValueError for every storage error
            raise CorruptCheckpointError(f"{self.path}: {self.key} does not read back: {_one_line(err)}") from None
        return out if dtype is None else out.astype(dtype, copy=False)


def open_leaves(path: str, keys: list[str] | None = None) -> tuple[dict[str, LeafReader], dict[str, Any]]:
    """``({key path: LeafReader}, metadata)`` of a committed checkpoint, its records verified (COMMIT,
    every process's part, the index) but no array read yet; ``keys``: only those leaves. JAX-free."""
    import tensorstore as ts  # the train extra; records are read without it

    commit = read_commit(path)
    if commit is None:
        raise FileNotFoundError(f"{path} is not a committed checkpoint (no valid {_COMMIT})")
    if is_legacy(commit):
        raise CorruptCheckpointError(f"{path} is in the earlier single-blob format: run `marin convert-checkpoints` "
                                     "on its run directory first")
    verify_parts(path, commit)
    index = read_index(path)
    by_key = {e["key"]: e for e in index["leaves"]}
    out = {}
    for key in keys if keys is not None else list(by_key):
        if key not in by_key:
            raise CheckpointMismatchError(f"{path} has no leaf {key}")
        spec = {"driver": "zarr3", "kvstore": kvstore_spec(f"{path}/{by_key[key]['array']}"),
                "fill_missing_data_reads": False}
        try:
            out[key] = LeafReader(path, key, ts.open(spec, open=True, read=True).result())
        except Exception as err:  # noqa: BLE001 - tensorstore raises ValueError for every storage error
            raise CorruptCheckpointError(f"{path}: {key} cannot be opened: {_one_line(err)}") from None
    return out, index["metadata"]


def _index_key(idx: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(sl.indices(n)[:2] for sl, n in zip(idx, shape, strict=True))


def restore_checkpoint(path: str, template: Any = None, shardings: Any = None, *,
                       partial: bool = False) -> tuple[Any, dict[str, Any]]:
    """Restore a committed checkpoint; returns ``(tree, metadata)``.

    ``template``: a pytree (arrays or ``jax.ShapeDtypeStruct``s) the checkpoint must match leaf for
    leaf (:class:`CheckpointMismatchError` names every difference); the result has its structure.
    Without it, the result is a flat ``{key path: array}`` dict. ``shardings``: a pytree of
    ``jax.sharding.Sharding`` matching ``template`` (or one sharding for all leaves): the leaves come
    back as global arrays laid out for *this* pool's mesh, whatever mesh wrote them; each process reads
    only its slices. ``shardings=None`` reads every leaf whole into this process (export only).
    ``partial``: read only the template's leaves of a checkpoint that holds more. Data that does not
    verify raises :class:`CorruptCheckpointError`.
    """
    import jax  # not at the top: review and planning read checkpoint records without JAX

    commit = read_commit(path)
    if commit is None:
        raise FileNotFoundError(f"{path} is not a committed checkpoint (no valid {_COMMIT})")
    if is_legacy(commit):
        return _restore_legacy(path, commit, template, shardings, partial)
    verify_parts(path, commit)
    index = read_index(path)
    entries = index["leaves"]
    if template is not None:
        check_template(path, entries, template, partial=partial)
        keys, _, treedef = flatten_with_keys(template)
    else:
        keys, treedef = [e["key"] for e in entries], None
    leaf_shardings = _leaf_shardings(shardings, template, len(keys))
    leaves = _read_leaves(path, entries, keys, leaf_shardings)
    if treedef is None:
        return dict(zip(keys, leaves, strict=True)), index["metadata"]
    return jax.tree_util.tree_unflatten(treedef, leaves), index["metadata"]


def _leaf_shardings(shardings: Any, template: Any, n: int) -> list[Any] | None:
    import jax  # not at the top: review and planning read checkpoint records without JAX

    if shardings is None:
        return None
    if isinstance(shardings, jax.sharding.Sharding):
        return [shardings] * n
    if template is None:
        raise ValueError("per-leaf shardings need a template of the same structure")
    return jax.tree_util.tree_structure(template).flatten_up_to(shardings)


def read_checkpoint(path: str, template: Any = None, *, verify: bool = True) -> tuple[Any, dict[str, Any]]:
    """Every leaf of a committed checkpoint as numpy arrays in this process; ``(tree, metadata)``.

    This reads the whole state into one process: for exports and small tests only (a training or
    evaluation process restores with :func:`restore_checkpoint` and shardings). ``verify`` is kept for
    older callers: chunks always verify their checksums.
    """
    del verify
    return restore_checkpoint(path, template, None)


# ---- the earlier single-blob format (read only) -------------------------------------------------------
def _restore_legacy(path: str, commit: Mapping[str, Any], template: Any, shardings: Any,
                    partial: bool = False) -> tuple[Any, dict[str, Any]]:
    """Read a checkpoint of the earlier format: one ``arrays.bin`` blob, verified against the sha256 in
    its COMMIT. These were written by one process for states that fit in one; they are read whole and
    then placed onto ``shardings``."""
    import jax  # not at the top: review and planning read checkpoint records without JAX

    fs, root = fsspec.core.url_to_fs(path)
    index = read_index(path)
    if template is not None:
        check_template(path, index["leaves"], template, partial=partial)
    try:
        blob = fs.cat_file(f"{root}/{_LEGACY_ARRAYS}")
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: {_LEGACY_ARRAYS} is missing") from None
    if len(blob) != commit["nbytes"]:
        raise CorruptCheckpointError(f"{path}: {_LEGACY_ARRAYS} has {len(blob)} bytes, COMMIT says {commit['nbytes']}")
    if hashlib.sha256(blob).hexdigest() != commit["sha256"]:
        raise CorruptCheckpointError(f"{path}: {_LEGACY_ARRAYS} does not match the sha256 in COMMIT")
    arrays = {}
    for e in index["leaves"]:
        raw = blob[e["offset"] : e["offset"] + e["nbytes"]]
        arrays[e["key"]] = np.frombuffer(raw, dtype=_dtype(e["dtype"])).reshape(e["shape"]).copy()
    keys = list(arrays) if template is None else flatten_with_keys(template)[0]
    leaves = [arrays[k] for k in keys]
    per_leaf = _leaf_shardings(shardings, template, len(keys))
    if per_leaf is not None:
        leaves = [jax.make_array_from_callback(a.shape, s, lambda idx, a=a: a[idx]) for a, s in
                  zip(leaves, per_leaf, strict=True)]
    if template is None:
        return dict(zip(keys, leaves, strict=True)), index["metadata"]
    return jax.tree_util.tree_unflatten(flatten_with_keys(template)[2], leaves), index["metadata"]


# ---- the manager -------------------------------------------------------------------------------------
def _delete_dir(fs: Any, root: str) -> None:
    # COMMIT first, so that a crash during deletion never leaves a complete-looking half checkpoint.
    if fs.exists(f"{root}/{_COMMIT}"):
        fs.rm_file(f"{root}/{_COMMIT}")
    if fs.exists(root):
        fs.rm(root, recursive=True)


class _Store:
    """One tier's checkpoint directory: discovery, commit checks and deletion on its filesystem."""

    def __init__(self, root_url: str, tier: str) -> None:
        self.root_url, self.tier = root_url, tier
        self.fs, self.root = fsspec.core.url_to_fs(root_url)

    def url(self, step: int) -> str:
        return f"{self.root_url}/{step_dirname(step)}"

    def fs_path(self, step: int) -> str:
        return f"{self.root}/{step_dirname(step)}"

    def step_dirs(self) -> dict[int, str]:
        if hasattr(self.fs, "invalidate_cache"):
            self.fs.invalidate_cache(self.root)
        if not self.fs.exists(self.root):
            return {}
        found = {}
        for p in self.fs.ls(self.root, detail=False):
            m = _STEP_RE.match(p.rstrip("/").rsplit("/", 1)[-1])
            if m:
                found[int(m.group(1))] = p.rstrip("/")
        return found

    def is_committed(self, fs_path: str) -> bool:
        try:
            commit = json.loads(self.fs.cat_file(f"{fs_path}/{_COMMIT}"))
        except (FileNotFoundError, json.JSONDecodeError):
            return False
        return isinstance(commit, dict) and ("format" in commit or "sha256" in commit)

    def committed_steps(self) -> list[int]:
        return sorted(s for s, p in self.step_dirs().items() if self.is_committed(p))

    def move_aside(self, step: int, aside_url: str) -> None:
        try:
            self.fs.mv(self.fs_path(step), fsspec.core.url_to_fs(aside_url)[1], recursive=True)
        except FileNotFoundError:  # another process of the pool moved it first
            pass


class CheckpointManager:
    """Periodic asynchronous saves, retention and discovery of checkpoints under
    ``{output_path}/checkpoints`` and, with ``temp_path``, of the rolling temporary checkpoint under
    :func:`temp_checkpoint_root` of that fast store.

    Every process of a pool creates one and calls :meth:`save` at the same steps; each writes its own
    shards. Process 0 (``is_writer``) writes the index and COMMIT and applies retention. At most one
    save is in flight: :meth:`save` waits for the previous one first, and :meth:`wait` (called at the
    end of a run) for the last. A failed permanent save surfaces as :class:`CheckpointWriteError` from
    the next :meth:`save`, :meth:`check` or :meth:`wait`; a failed temporary one is logged and skipped
    (the permanent checkpoints still protect the run).

    Resume (:meth:`restore_latest`) takes the newest committed checkpoint of either tier (the permanent
    one where both hold the same step). A temporary store that cannot be read (gone, unreachable,
    permission denied) is logged and the permanent checkpoints are used. Evaluation, sampling and export
    read only the permanent ones (:func:`committed_steps`): the temporary one exists to resume.
    """

    def __init__(self, output_path: str, policy: CheckpointPolicy, *, is_writer: bool = True,
                 part_timeout_s: float = PART_TIMEOUT_S, temp_path: str | None = None) -> None:
        self.permanent = _Store(f"{output_path.rstrip('/')}/{CHECKPOINT_DIR}", PERMANENT)
        self.root_url, self.fs, self.root = self.permanent.root_url, self.permanent.fs, self.permanent.root
        self.temporary = _Store(temp_checkpoint_root(temp_path, output_path), TEMPORARY) if temp_path else None
        self.policy = policy
        self.is_writer = is_writer
        self.part_timeout_s = part_timeout_s
        self._last_save_step: int | None = None
        self._last_save_time = time.monotonic()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._in_flight: concurrent.futures.Future | None = None
        self._save_started = 0.0
        self.last_blocking_s = 0.0  # time the latest save held the caller (staging to host memory)
        self.last_save_s: float | None = None  # staging + writing + commit of the latest finished save

    def path_for(self, step: int) -> str:
        """The directory of the committed checkpoint at ``step`` in whichever tier holds it (the
        permanent one where both do); the permanent directory for a step not committed anywhere."""
        found = self.committed().get(step)
        return found if found is not None else self.permanent.url(step)

    def _step_dirs(self) -> dict[int, str]:
        return self.permanent.step_dirs()

    def committed_steps(self) -> list[int]:
        """Steps with a complete permanent checkpoint, ascending."""
        return self.permanent.committed_steps()

    def _is_committed(self, fs_path: str) -> bool:
        return self.permanent.is_committed(fs_path)

    def _temp_steps(self) -> list[int]:
        """The committed temporary checkpoints; none, with a warning, when the store cannot be read."""
        if self.temporary is None:
            return []
        try:
            return self.temporary.committed_steps()
        except Exception as e:  # noqa: BLE001 - every storage library's error means "not usable now"
            logger.warning("the temporary checkpoint store %s cannot be read (%s); using the permanent checkpoints",
                           self.temporary.root_url, _one_line(e))
            return []

    def committed(self) -> dict[int, str]:
        """``{step: checkpoint directory}`` of every committed checkpoint of both tiers; a step both
        hold maps to the permanent one."""
        found = {s: self.temporary.url(s) for s in self._temp_steps()} if self.temporary is not None else {}
        found.update({s: self.permanent.url(s) for s in self.committed_steps()})
        return dict(sorted(found.items()))

    def latest_step(self) -> int | None:
        """The newest committed checkpoint of either tier."""
        steps = list(self.committed())
        return steps[-1] if steps else None

    def should_save(self, step: int, *, now: float | None = None) -> bool:
        """Whether a permanent checkpoint of the state after ``step`` completed steps is due."""
        if step > 0 and step % self.policy.every_steps == 0:
            return True
        if self.policy.every_minutes is not None and step != self._last_save_step:
            now = time.monotonic() if now is None else now
            return now - self._last_save_time >= 60.0 * self.policy.every_minutes
        return False

    def due(self, step: int, *, now: float | None = None) -> str | None:
        """Which checkpoint of the state after ``step`` is due: :data:`PERMANENT`, :data:`TEMPORARY`
        (the wall time since the last save of either tier reached ``temp_every_minutes``) or None."""
        now = time.monotonic() if now is None else now
        if self.should_save(step, now=now):
            return PERMANENT
        every = self.policy.temp_every_minutes
        if (self.temporary is not None and every is not None and step > 0 and step != self._last_save_step
                and now - self._last_save_time >= 60.0 * every):
            return TEMPORARY
        return None

    def save(self, step: int, tree: Any, metadata: Mapping[str, Any], *, blocking: bool = False,
             tier: str = PERMANENT) -> str:
        """Start saving ``tree`` as the checkpoint of ``step`` in ``tier``: waits for the previous save,
        copies this process's shards to host memory, and writes them in the background
        (``blocking=True``: waits for the commit too)."""
        if tier not in (PERMANENT, TEMPORARY) or (tier == TEMPORARY and self.temporary is None):
            raise ValueError(f"cannot save a {tier!r} checkpoint (temporary store: "
                             f"{self.temporary.root_url if self.temporary else 'none'})")
        store = self.permanent if tier == PERMANENT else self.temporary
        self.wait()
        t0 = time.perf_counter()
        path = store.url(step)
        _, count = _process()
        if count == 1:
            try:
                if store.fs.exists(store.fs_path(step)):
                    # A leftover of a crashed attempt at the same step: never committed (a committed one
                    # would have been resumed from), safe to replace. (With several processes, the writer
                    # clears leftovers before training starts: see clear_uncommitted.)
                    _delete_dir(store.fs, store.fs_path(step))
            except Exception:
                if tier == PERMANENT:
                    raise
                # an unreachable temporary store: the write below fails and is logged
        staged = stage(path, tree, metadata, step=step)
        self.last_blocking_s = time.perf_counter() - t0
        self._save_started = t0
        self._last_save_step = step
        self._last_save_time = time.monotonic()
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._in_flight = self._pool.submit(self._write, staged, store)
        if blocking:
            self.wait()
        return path

    def save_temporary(self, step: int, tree: Any, metadata: Mapping[str, Any], *, blocking: bool = False) -> str:
        """:meth:`save` to the temporary store (the rolling checkpoint: one kept)."""
        return self.save(step, tree, metadata, blocking=blocking, tier=TEMPORARY)

    def _write(self, staged: _Staged, store: _Store | None = None) -> None:
        store = store or self.permanent
        try:
            write_staged(staged, part_timeout_s=self.part_timeout_s)
        except CheckpointWriteError as e:
            if store.tier == PERMANENT:
                raise
            logger.warning("temporary checkpoint skipped: %s (the permanent checkpoints still protect the run)", e)
            return
        self.last_save_s = time.perf_counter() - self._save_started
        logger.info("saved %s checkpoint %s (%.1f MB from this process)", store.tier, staged.path, staged.nbytes / 1e6)
        if not self.is_writer:
            return
        if store.tier == PERMANENT:
            self.collect_garbage(current=staged.step)
            self._prune_temporary(through=staged.step)
        else:
            self._prune_temporary(keep=staged.step)

    def _prune_temporary(self, *, keep: int | None = None, through: int | None = None) -> list[int]:
        """Delete temporary checkpoints: every one but ``keep`` (one kept), or every one at or before
        ``through`` (a newer permanent one committed). Failures are logged: the store may be gone."""
        if self.temporary is None:
            return []
        deleted = []
        try:
            for s, p in sorted(self.temporary.step_dirs().items()):
                if (keep is not None and s != keep) or (through is not None and s <= through):
                    _delete_dir(self.temporary.fs, p)
                    deleted.append(s)
        except Exception as e:  # noqa: BLE001 - every storage library's error means "not usable now"
            logger.warning("could not prune the temporary checkpoints in %s: %s", self.temporary.root_url, _one_line(e))
        return deleted

    def check(self) -> None:
        """Raise the error of a finished background save, if it failed (cheap; call once per step)."""
        f = self._in_flight
        if f is not None and f.done():
            self._in_flight = None
            f.result()

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; raises its error."""
        f, self._in_flight = self._in_flight, None
        if f is not None:
            f.result()

    def close(self) -> None:
        """Wait for the save in flight and stop the writer thread."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def restore(self, step: int, template: Any = None, shardings: Any = None) -> tuple[Any, dict[str, Any]]:
        return restore_checkpoint(self.path_for(step), template, shardings)

    def restore_latest(self, template: Any = None, shardings: Any = None) -> tuple[int, Any, dict[str, Any]] | None:
        """``(step, tree, metadata)`` of the newest checkpoint of either tier that verifies, or None if
        there is none.

        A committed checkpoint that fails verification (a part missing, a chunk truncated by a kill
        during a copy, a lost file) is logged, moved aside to ``step-N.corrupt-<unix time>`` (kept for
        inspection, ignored by discovery and retention) and the next older one is tried: one damaged
        checkpoint costs the steps since the previous save, not the run. A temporary checkpoint that
        cannot be read at all (its store went away between listing and reading) is skipped the same
        way. A structural mismatch is not damage and is raised as is.
        """
        for step, url in reversed(list(self.committed().items())):
            store = self.permanent if url == self.permanent.url(step) else self.temporary
            try:
                tree, meta = restore_checkpoint(url, template, shardings)
            except (CorruptCheckpointError, FileNotFoundError) as e:
                aside = f"{url}.corrupt-{int(time.time())}"
                logger.warning("%s checkpoint at step %d does not verify (%s); moving it to %s and trying the "
                               "previous one", store.tier, step, e, aside)
                if self.is_writer:
                    try:
                        store.move_aside(step, aside)
                    except Exception as moved:  # noqa: BLE001 - a vanished temporary store cannot take it
                        if store.tier == PERMANENT:
                            raise
                        logger.warning("could not move %s aside: %s", url, _one_line(moved))
                continue
            except CheckpointMismatchError:
                raise
            except Exception as e:  # noqa: BLE001 - a temporary store that stopped answering mid-read
                if store.tier == PERMANENT:
                    raise
                logger.warning("temporary checkpoint at step %d cannot be read (%s); trying the previous one",
                               step, _one_line(e))
                continue
            if store.tier == TEMPORARY:
                logger.info("resuming from the temporary checkpoint %s (newer than every permanent one)", url)
            return step, tree, meta
        return None

    def _move_aside(self, step: int, aside_url: str) -> None:
        self.permanent.move_aside(step, aside_url)

    def mark_restored(self, step: int) -> None:
        """Start the wall-time clock from a restore, as if that checkpoint had just been written."""
        self._last_save_step = step
        self._last_save_time = time.monotonic()

    def clear_uncommitted(self) -> list[int]:
        """Delete step directories without COMMIT (a crashed save's leftovers), in both tiers. Only the
        writer calls this, before training starts, so no save of this attempt is racing it."""
        deleted = []
        for s, p in sorted(self._step_dirs().items()):
            if not self._is_committed(p):
                _delete_dir(self.fs, p)
                deleted.append(s)
        if self.temporary is not None:
            try:
                for p in self.temporary.step_dirs().values():
                    if not self.temporary.is_committed(p):
                        _delete_dir(self.temporary.fs, p)
            except Exception as e:  # noqa: BLE001 - every storage library's error means "not usable now"
                logger.warning("could not clear the temporary checkpoint store %s: %s", self.temporary.root_url,
                               _one_line(e))
        return deleted

    def collect_garbage(self, current: int | None = None) -> list[int]:
        """Delete uncommitted leftovers and committed permanent checkpoints outside the retention policy."""
        dirs = self._step_dirs()
        committed = sorted(s for s, p in dirs.items() if self._is_committed(p))
        keep = set(committed[-self.policy.keep_last :])
        if self.policy.keep_every:
            keep |= {s for s in committed if s % self.policy.keep_every == 0}
        deleted = []
        for s, p in sorted(dirs.items()):
            if s in keep or s == current:
                continue
            _delete_dir(self.fs, p)
            deleted.append(s)
        return deleted


# ---- loading a trained model -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A training run's model at one checkpoint: what sampling, export and evaluation need."""

    config: Any  # marin.models.config.MoEConfig, exactly as the run trained it
    params: Any  # nested dict of arrays (global jax Arrays on the mesh given, or numpy)
    router_bias: Any  # [moe layers, experts]: part of the model's forward, not only of training
    metadata: dict[str, Any]  # the checkpoint's: config record, step, tokens, data position
    step: int
    path: str  # the checkpoint directory


def committed_steps(run_path: str) -> list[int]:
    """Steps of the committed checkpoints of the training run at ``run_path``, ascending (half-written
    ones are never listed)."""
    return CheckpointManager(run_path, CheckpointPolicy()).committed_steps()


def checkpoint_path(run_path: str, step: int) -> str:
    """The directory of the run's checkpoint at ``step``."""
    return CheckpointManager(run_path, CheckpointPolicy()).path_for(step)


def select_steps(run_path: str, checkpoint: str | int | None = "latest", *,
                 steps: list[int] | None = None) -> list[int]:
    """The committed checkpoints of the run at ``run_path`` that ``checkpoint`` names, ascending:
    "latest" (or None) the newest, "all" every retained one, or a step number; FileNotFoundError
    saying what is there when the run has none, or none at that step. ``steps``: the run's committed
    steps when the caller has listed them already."""
    steps = committed_steps(run_path) if steps is None else steps
    if not steps:
        raise FileNotFoundError(f"{run_path} has no committed checkpoint (is it a training step's output directory?)")
    if checkpoint is None or checkpoint == "latest":
        return steps[-1:]
    if checkpoint == "all":
        return steps
    try:
        step = int(checkpoint)
    except (TypeError, ValueError):
        raise ValueError(f"checkpoint must be 'latest', 'all' or a step number, got {checkpoint!r}") from None
    if step not in steps:
        raise FileNotFoundError(f"{run_path} has no committed checkpoint at step {step}; committed: {steps}")
    return [step]


def checkpoint_step(run_path: str, step: int | None = None) -> int:
    """``step`` if the run at ``run_path`` has a committed checkpoint there, else (None) its newest;
    FileNotFoundError saying what is there otherwise."""
    return select_steps(run_path, step)[0]


def model_config_of(metadata: Mapping[str, Any]) -> Any:
    """The MoEConfig a checkpoint's run trained, from its metadata's config record."""
    from marin.models.config import MoEConfig  # kept off the light import path of CheckpointPolicy

    model = metadata["config"]["model"]
    if not isinstance(model, dict):
        raise ValueError(f"the checkpoint's config names model {model!r} without its fields; it predates recorded "
                         "model configs and cannot be loaded by itself")
    return from_jsonable(MoEConfig, model)


def load_model(run_path: str, mesh: Any = None, *, step: int | None = None,
               param_sharding: str = "replicated") -> LoadedModel:
    """Load a training run's model for inference: its config, params and router bias (no optimizer
    state), restored onto ``mesh`` whatever pool wrote it; each process reads only the slices its
    devices hold. ``step``: a committed checkpoint's step (default: the newest). ``param_sharding``:
    "replicated" or "fsdp" (marin.parallel.layout; expert weights are split over "expert" either
    way). ``mesh=None`` reads the model whole into this process as numpy arrays (export)."""
    import jax  # not at the top: review and planning read checkpoint records without JAX

    from marin.models.transformer import init_params, init_router_bias  # JAX only when a model is loaded

    step = checkpoint_step(run_path, step)
    path = checkpoint_path(run_path, step)
    meta = read_metadata(path)
    cfg = model_config_of(meta)
    template = {"params": jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0))),
                "router_bias": jax.eval_shape(lambda: init_router_bias(cfg))}
    shardings = None
    if mesh is not None:
        from marin.parallel.mesh import param_shardings, replicated  # JAX only when a mesh is given

        shardings = {"params": param_shardings(template["params"], mesh, param_sharding),
                     "router_bias": replicated(mesh)}
    tree, meta = restore_checkpoint(path, template, shardings, partial=True)
    return LoadedModel(cfg, tree["params"], tree["router_bias"], meta, step, path)


def read_full_state(run_path: str, *, step: int | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Every leaf of a run's checkpoint (optimizer state included), whole, as numpy arrays in this
    one process: ``({key path: array}, metadata)``. For an export the user asks for explicitly; a
    hero checkpoint is about 6.4 TB, so anything that runs on a pool uses :func:`load_model` or
    :func:`restore_checkpoint` with shardings instead."""
    return read_checkpoint(checkpoint_path(run_path, checkpoint_step(run_path, step)))


# ---- conversion ----------------------------------------------------------------------------------------
def convert_legacy(run_path: str) -> list[int]:
    """Rewrite every committed checkpoint of the earlier single-blob format under ``run_path`` in
    the sharded format (in place: the new one is committed before the old blob is deleted)."""
    mgr = CheckpointManager(run_path, CheckpointPolicy())
    converted = []
    for step in mgr.committed_steps():
        path = mgr.path_for(step)
        commit = read_commit(path)
        if commit is None or not is_legacy(commit):
            continue
        flat, meta = read_checkpoint(path)
        index = read_index(path)
        tmp = f"{path}.converting"
        keys = [e["key"] for e in index["leaves"]]
        write_staged(stage_leaves(tmp, keys, [flat[k] for k in keys], meta, step=step))
        fs, root = fsspec.core.url_to_fs(path)
        _delete_dir(fs, root)
        fs.mv(fsspec.core.url_to_fs(tmp)[1], root, recursive=True)
        converted.append(step)
    return converted
