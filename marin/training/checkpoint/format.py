"""The on-disk format of a checkpoint: its layout and records (index, parts, COMMIT or ABORT), the
storage specs its arrays are written with, the checks a restore makes before reading any array, and
one tier's checkpoint directory (:class:`TierStore`: its step directories, which are committed,
deletion COMMIT first).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any

import fsspec
import numpy as np

CHECKPOINT_DIR = "checkpoints"
FORMAT = "zarr3-sharded-v1"
_STEP_RE = re.compile(r"^step-(\d{8,})$")
INDEX_FILE = "index.json"
COMMIT_FILE = "COMMIT"
ABORT_FILE = "ABORT"
"""Process 0's verdict that a save failed, written instead of COMMIT: the other processes read the
save's outcome from the store (COMMIT or ABORT) instead of each deciding on its own timeout. Not a
checkpoint (no COMMIT): readers ignore the directory and retention deletes it."""
ARRAYS_DIR = "arrays"
PARTS_DIR = "parts"
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


PERMANENT = "permanent"
TEMPORARY = "temporary"


def step_dirname(step: int) -> str:
    return f"step-{step:08d}"


def flatten_with_keys(tree: Any) -> tuple[list[str], list[Any], Any]:
    """``(key paths, leaves, treedef)``: leaves are matched to checkpoint entries by key path."""
    import jax  # not at the top: review and planning read checkpoint records without JAX

    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    keys = [jax.tree_util.keystr(path) for path, _ in leaves_with_path]
    return keys, [leaf for _, leaf in leaves_with_path], treedef


def stored_dtype(name: str) -> np.dtype:
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


def process_and_count() -> tuple[int, int]:
    import jax  # not at the top: review and planning read checkpoint records without JAX

    return jax.process_index(), jax.process_count()


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


def part_name(process: int) -> str:
    return f"process-{process:05d}.json"


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text if len(text) < 300 else text[:300] + "..."


def read_commit(path: str) -> dict[str, Any] | None:
    """The COMMIT record of checkpoint directory ``path``, or None if it is not complete."""
    fs, root = fsspec.core.url_to_fs(path)
    try:
        commit = json.loads(fs.cat_file(f"{root}/{COMMIT_FILE}"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return commit if isinstance(commit, dict) and "format" in commit else None


def read_index(path: str) -> dict[str, Any]:
    fs, root = fsspec.core.url_to_fs(path)
    try:
        return json.loads(fs.cat_file(f"{root}/{INDEX_FILE}"))
    except (FileNotFoundError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"{path}: {INDEX_FILE} is missing or unreadable ({type(e).__name__})") from None


def read_metadata(path: str) -> dict[str, Any]:
    """The caller metadata of a committed checkpoint (config, step, tokens, data position), without
    reading its arrays."""
    if read_commit(path) is None:
        raise FileNotFoundError(f"{path} is not a committed checkpoint (no valid {COMMIT_FILE})")
    return read_index(path)["metadata"]


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
        have = _describe(stored_dtype(saved[k]["dtype"]), saved[k]["shape"])
        if have != want:
            problems.append(f"{k}: checkpoint {have}, model wants {want}")
    if not partial:
        problems += [f"{k}: in the checkpoint ({_describe(stored_dtype(e['dtype']), e['shape'])}) but not in the model"
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
            part = json.loads(fs.cat_file(f"{root}/{PARTS_DIR}/{part_name(p)}"))
        except (FileNotFoundError, json.JSONDecodeError) as e:
            raise CorruptCheckpointError(
                f"{path}: part {PARTS_DIR}/{part_name(p)} (process {p} of {count}) is missing or unreadable "
                f"({type(e).__name__})") from None
        if part.get("step") != commit.get("step"):
            raise CorruptCheckpointError(f"{path}: part {part_name(p)} is of step {part.get('step')}, "
                                         f"not {commit.get('step')}")


CHECKSUM_BYTES = 4
"""What the crc32c codec appends to every stored chunk (see the array spec in ``save``)."""


def chunk_damage(path: str) -> list[str]:
    """A cheap check of a committed checkpoint's stored chunks against its index, from one listing of
    its arrays (no chunk is read, so no checksum is verified): every array has every chunk of its
    grid, each exactly the size its chunk shape and dtype give (every chunk is stored whole, edge
    and all-zero ones too). A copy or write cut short leaves a chunk shorter or missing. Returns one
    line per damaged array (first chunk named), [] when all is in place."""
    fs, root = fsspec.core.url_to_fs(path)
    try:
        leaves = read_index(path)["leaves"]
        found = fs.find(f"{root}/{ARRAYS_DIR}", detail=True)
    except (CorruptCheckpointError, KeyError) as e:
        return [f"its index does not read ({one_line(e)})"]
    sizes = {name[len(root) + 1:]: int(info.get("size") or 0) for name, info in found.items()}
    problems = []
    for leaf in leaves:
        chunk = [max(1, c) for c in leaf["chunk"]]
        want = math.prod(chunk) * stored_dtype(leaf["dtype"]).itemsize + CHECKSUM_BYTES
        grid = [range(math.ceil(n / c)) for n, c in zip(leaf["shape"], chunk, strict=True)]
        keys = ["/".join(["c", *map(str, at)]) for at in itertools.product(*grid)]
        bad = [(k, sizes.get(f"{leaf['array']}/{k}")) for k in keys if sizes.get(f"{leaf['array']}/{k}") != want]
        if bad:
            key, size = bad[0]
            what = "missing" if size is None else f"{size:,} bytes, {want:,} expected"
            problems.append(f"{leaf['key']}: chunk {key} {what}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1
                                                                     else ""))
    return problems


def shardings_per_leaf(shardings: Any, template: Any, n: int) -> list[Any] | None:
    import jax  # not at the top: review and planning read checkpoint records without JAX

    if shardings is None:
        return None
    if isinstance(shardings, jax.sharding.Sharding):
        return [shardings] * n
    if template is None:
        raise ValueError("per-leaf shardings need a template of the same structure")
    return jax.tree_util.tree_structure(template).flatten_up_to(shardings)


def delete_dir(fs: Any, root: str) -> None:
    # COMMIT first, so that a crash during deletion never leaves a complete-looking half checkpoint.
    if fs.exists(f"{root}/{COMMIT_FILE}"):
        fs.rm_file(f"{root}/{COMMIT_FILE}")
    if fs.exists(root):
        fs.rm(root, recursive=True)


class TierStore:
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
            commit = json.loads(self.fs.cat_file(f"{fs_path}/{COMMIT_FILE}"))
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
