"""Atomic checkpoints of a training state pytree, on local disk or object stores through fsspec.

Layout under a step's output directory::

    checkpoints/step-00000100/arrays.bin   every leaf's raw bytes, concatenated
    checkpoints/step-00000100/index.json   key path, dtype, shape, offset of each leaf + caller metadata
    checkpoints/step-00000100/COMMIT       written last: step, byte count and sha256 of arrays.bin

Why a commit marker instead of a directory rename: object stores have no atomic rename, but a single
small PUT is atomic everywhere. A checkpoint is complete exactly when its COMMIT exists and matches the
data, so a crash at any point of a save leaves either the previous checkpoints alone or a directory
that readers ignore (and the next save deletes). Deletion removes COMMIT first for the same reason.

orbax is not part of the install; this format is deliberately plain (a blob and a JSON index) so that
evaluation steps and operators can read checkpoints with numpy alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import time
from collections.abc import Mapping
from typing import Any

import fsspec
import numpy as np

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
_STEP_RE = re.compile(r"^step-(\d{8,})$")
_ARRAYS = "arrays.bin"
_INDEX = "index.json"
_COMMIT = "COMMIT"


class CorruptCheckpointError(OSError):
    """A committed checkpoint whose files do not verify against its COMMIT (for example
    ``arrays.bin`` truncated by a kill during a copy, or a lost file)."""


class CheckpointMismatchError(ValueError):
    """A checkpoint whose leaves do not fit the state being restored: the model's structure (or the
    optimizer's) differs from the one that wrote it."""


@dataclasses.dataclass(frozen=True)
class CheckpointPolicy:
    """When to save and what to keep.

    Saves happen every ``every_steps`` steps and additionally whenever ``every_minutes`` of wall time
    passed since the last save (so a slow run still loses little work). The newest ``keep_last``
    checkpoints are kept; checkpoints at multiples of ``keep_every`` are permanent (for evaluation and
    for branching, e.g. the early-cooldown side branch). The final step is always saved.
    """

    every_steps: int = 100
    every_minutes: float | None = None
    keep_last: int = 2
    keep_every: int | None = None

    def __post_init__(self) -> None:
        if self.every_steps <= 0:
            raise ValueError(f"every_steps must be > 0, got {self.every_steps}")
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {self.keep_last}")
        if self.keep_every is not None and self.keep_every <= 0:
            raise ValueError(f"keep_every must be > 0, got {self.keep_every}")


def step_dirname(step: int) -> str:
    return f"step-{step:08d}"


def _flatten(tree: Any) -> tuple[list[str], list[Any], Any]:
    import jax

    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    keys = [jax.tree_util.keystr(path) for path, _ in leaves_with_path]
    return keys, [leaf for _, leaf in leaves_with_path], treedef


def _to_host(leaf: Any) -> np.ndarray:
    """A numpy copy of a (possibly multi-process sharded) array; collective when not addressable."""
    import jax

    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return np.asarray(leaf)


def _dtype(name: str) -> np.dtype:
    import ml_dtypes  # registers bfloat16 and friends with numpy

    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


def write_checkpoint(path: str, tree: Any, metadata: Mapping[str, Any], *, step: int, is_writer: bool = True) -> None:
    """Write ``tree`` and JSON-able ``metadata`` to directory ``path``; COMMIT goes last.

    Every process must call this (gathering sharded arrays is collective); only ``is_writer`` writes.
    """
    keys, leaves, _ = _flatten(tree)
    host_leaves = [_to_host(x) for x in leaves]
    if not is_writer:
        return
    fs, root = fsspec.core.url_to_fs(path)
    if fs.exists(root):
        # A leftover of a crashed attempt at the same step: never committed, safe to replace.
        _delete_dir(fs, root)
    fs.makedirs(root, exist_ok=True)
    entries = []
    offset = 0
    digest = hashlib.sha256()
    chunks = []
    for key, arr in zip(keys, host_leaves, strict=True):
        data = np.ascontiguousarray(arr).tobytes()
        entries.append(
            {"key": key, "dtype": arr.dtype.name, "shape": list(arr.shape), "offset": offset, "nbytes": len(data)}
        )
        offset += len(data)
        digest.update(data)
        chunks.append(data)
    blob = b"".join(chunks)
    fs.pipe_file(f"{root}/{_ARRAYS}", blob)
    index = {"step": step, "leaves": entries, "metadata": dict(metadata)}
    fs.pipe_file(f"{root}/{_INDEX}", json.dumps(index, indent=1, sort_keys=True).encode())
    commit = {"step": step, "nbytes": len(blob), "sha256": digest.hexdigest(), "time": time.time()}
    _commit(fs, f"{root}/{_COMMIT}", json.dumps(commit).encode())


def _commit(fs: Any, path: str, data: bytes) -> None:
    """Single atomic write of the marker: rename on local disk, one PUT on object stores."""
    from fsspec.implementations.local import LocalFileSystem

    if isinstance(fs, LocalFileSystem):
        tmp = f"{path}.tmp"
        fs.pipe_file(tmp, data)
        fs.mv(tmp, path)
    else:
        fs.pipe_file(path, data)


def read_commit(path: str) -> dict[str, Any] | None:
    """The COMMIT record of checkpoint directory ``path``, or None if it is not complete."""
    fs, root = fsspec.core.url_to_fs(path)
    try:
        raw = fs.cat_file(f"{root}/{_COMMIT}")
        return json.loads(raw)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def latest_checkpoint(output_path: str) -> str | None:
    """Path of the newest committed checkpoint of a training step's output directory, or None.

    This is how evaluation and later steps find a model: ``read_checkpoint(latest_checkpoint(p))``.
    """
    mgr = CheckpointManager(output_path, CheckpointPolicy())
    step = mgr.latest_step()
    return None if step is None else mgr.path_for(step)


def read_metadata(path: str) -> dict[str, Any]:
    """The caller metadata of a committed checkpoint, without reading its arrays."""
    if read_commit(path) is None:
        raise FileNotFoundError(f"{path} is not a committed checkpoint (no valid {_COMMIT})")
    fs, root = fsspec.core.url_to_fs(path)
    return json.loads(fs.cat_file(f"{root}/{_INDEX}"))["metadata"]


def _describe(dtype: Any, shape: Any) -> str:
    return f"{np.dtype(dtype).name}{list(shape)}"


def check_template(path: str, entries: list[dict[str, Any]], template: Any) -> None:
    """Raise :class:`CheckpointMismatchError` naming every leaf whose presence, shape or dtype differs
    between the checkpoint's index and ``template`` (before any array is read)."""
    keys, leaves, _ = _flatten(template)
    saved = {e["key"]: e for e in entries}
    wanted = dict(zip(keys, leaves, strict=True))
    problems = []
    for k, leaf in wanted.items():
        want = _describe(leaf.dtype, np.shape(leaf))
        if k not in saved:
            problems.append(f"{k}: missing from the checkpoint (model wants {want})")
            continue
        have = _describe(_dtype(saved[k]["dtype"]), saved[k]["shape"])
        if have != want:
            problems.append(f"{k}: checkpoint {have}, model wants {want}")
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


def read_checkpoint(path: str, template: Any = None, *, verify: bool = True) -> tuple[Any, dict[str, Any]]:
    """Read a committed checkpoint; returns ``(tree, metadata)``.

    With ``template`` (a pytree of the same structure, e.g. freshly initialised state) the leaves are
    matched by key path and checked for shape and dtype (:class:`CheckpointMismatchError` names every
    difference), and the result has the template's structure. Without it, the result is a flat
    ``{key path: numpy array}`` dict (enough for evaluation scripts). Files that do not verify against
    COMMIT raise :class:`CorruptCheckpointError`.
    """
    fs, root = fsspec.core.url_to_fs(path)
    commit = read_commit(path)
    if commit is None:
        raise FileNotFoundError(f"{path} is not a committed checkpoint (no valid {_COMMIT})")
    try:
        index = json.loads(fs.cat_file(f"{root}/{_INDEX}"))
    except (FileNotFoundError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"{path}: {_INDEX} is missing or unreadable ({type(e).__name__})") from None
    if template is not None:
        check_template(path, index["leaves"], template)
    try:
        blob = fs.cat_file(f"{root}/{_ARRAYS}")
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: {_ARRAYS} is missing") from None
    if len(blob) != commit["nbytes"]:
        raise CorruptCheckpointError(f"{path}: {_ARRAYS} has {len(blob)} bytes, COMMIT says {commit['nbytes']}")
    if verify and hashlib.sha256(blob).hexdigest() != commit["sha256"]:
        raise CorruptCheckpointError(f"{path}: {_ARRAYS} does not match the sha256 in COMMIT")
    arrays = {}
    for e in index["leaves"]:
        raw = blob[e["offset"] : e["offset"] + e["nbytes"]]
        arrays[e["key"]] = np.frombuffer(raw, dtype=_dtype(e["dtype"])).reshape(e["shape"]).copy()
    if template is None:
        return arrays, index["metadata"]
    import jax

    keys, _, treedef = _flatten(template)
    return jax.tree_util.tree_unflatten(treedef, [arrays[k] for k in keys]), index["metadata"]


def _delete_dir(fs: Any, root: str) -> None:
    # COMMIT first, so that a crash during deletion never leaves a complete-looking half checkpoint.
    if fs.exists(f"{root}/{_COMMIT}"):
        fs.rm_file(f"{root}/{_COMMIT}")
    fs.rm(root, recursive=True)


class CheckpointManager:
    """Periodic saves, retention and discovery of checkpoints under ``{output_path}/checkpoints``."""

    def __init__(self, output_path: str, policy: CheckpointPolicy, *, is_writer: bool = True) -> None:
        self.root_url = f"{output_path.rstrip('/')}/{CHECKPOINT_DIR}"
        self.fs, self.root = fsspec.core.url_to_fs(self.root_url)
        self.policy = policy
        self.is_writer = is_writer
        self._last_save_step: int | None = None
        self._last_save_time = time.monotonic()

    def path_for(self, step: int) -> str:
        return f"{self.root_url}/{step_dirname(step)}"

    def _step_dirs(self) -> dict[int, str]:
        if not self.fs.exists(self.root):
            return {}
        found = {}
        for p in self.fs.ls(self.root, detail=False):
            m = _STEP_RE.match(p.rstrip("/").rsplit("/", 1)[-1])
            if m:
                found[int(m.group(1))] = p.rstrip("/")
        return found

    def committed_steps(self) -> list[int]:
        """Steps with a complete checkpoint, ascending."""
        return sorted(s for s, p in self._step_dirs().items() if self._is_committed(p))

    def _is_committed(self, fs_path: str) -> bool:
        try:
            commit = json.loads(self.fs.cat_file(f"{fs_path}/{_COMMIT}"))
        except (FileNotFoundError, json.JSONDecodeError):
            return False
        return isinstance(commit, dict) and "sha256" in commit

    def latest_step(self) -> int | None:
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def should_save(self, step: int, *, now: float | None = None) -> bool:
        """Whether the state after ``step`` completed steps is due to be saved."""
        if step > 0 and step % self.policy.every_steps == 0:
            return True
        if self.policy.every_minutes is not None and step != self._last_save_step:
            now = time.monotonic() if now is None else now
            return now - self._last_save_time >= 60.0 * self.policy.every_minutes
        return False

    def save(self, step: int, tree: Any, metadata: Mapping[str, Any]) -> str:
        path = self.path_for(step)
        write_checkpoint(path, tree, metadata, step=step, is_writer=self.is_writer)
        self._last_save_step = step
        self._last_save_time = time.monotonic()
        if self.is_writer:
            self.collect_garbage(current=step)
        logger.info("saved checkpoint %s", path)
        return path

    def restore(self, step: int, template: Any = None) -> tuple[Any, dict[str, Any]]:
        return read_checkpoint(self.path_for(step), template)

    def restore_latest(self, template: Any = None) -> tuple[int, Any, dict[str, Any]] | None:
        """``(step, tree, metadata)`` of the newest checkpoint that verifies, or None if there is none.

        A committed checkpoint that fails verification (a kill during a copy, a lost file) is logged,
        moved aside to ``step-N.corrupt-<unix time>`` (kept for inspection, ignored by discovery and
        retention) and the next older one is tried: one damaged checkpoint costs the steps since the
        previous save, not the run. A structural mismatch is not damage and is raised as is.
        """
        for step in reversed(self.committed_steps()):
            try:
                tree, meta = self.restore(step, template)
            except (CorruptCheckpointError, FileNotFoundError) as e:
                aside = f"{self.path_for(step)}.corrupt-{int(time.time())}"
                logger.warning("checkpoint at step %d does not verify (%s); moving it to %s and trying the previous "
                               "one", step, e, aside)
                if self.is_writer:
                    self._move_aside(step, aside)
                continue
            return step, tree, meta
        return None

    def _move_aside(self, step: int, aside_url: str) -> None:
        src = f"{self.root}/{step_dirname(step)}"
        dst = fsspec.core.url_to_fs(aside_url)[1]
        try:
            self.fs.mv(src, dst, recursive=True)
        except FileNotFoundError:  # another process of the pool moved it first
            pass

    def mark_restored(self, step: int) -> None:
        """Start the wall-time clock from a restore, as if that checkpoint had just been written."""
        self._last_save_step = step
        self._last_save_time = time.monotonic()

    def collect_garbage(self, current: int | None = None) -> list[int]:
        """Delete uncommitted leftovers and committed checkpoints outside the retention policy."""
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
