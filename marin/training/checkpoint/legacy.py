"""The earlier single-blob format (``arrays.bin`` + ``index.json`` + a COMMIT holding its sha256): read
whole (the restore dispatches here), and rewritten in the sharded format by
``marin convert-checkpoints``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import fsspec
import numpy as np

from marin.training.checkpoint.format import (
    CHECKPOINT_DIR,
    LEGACY_BLOB,
    PERMANENT,
    CorruptCheckpointError,
    TierStore,
    check_template,
    delete_dir,
    flatten_with_keys,
    is_legacy,
    read_commit,
    read_index,
    shardings_per_leaf,
    stored_dtype,
)
from marin.training.checkpoint.save import stage_leaves, write_staged


def restore_legacy(path: str, commit: Mapping[str, Any], template: Any, shardings: Any,
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
        blob = fs.cat_file(f"{root}/{LEGACY_BLOB}")
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: {LEGACY_BLOB} is missing") from None
    if len(blob) != commit["nbytes"]:
        raise CorruptCheckpointError(f"{path}: {LEGACY_BLOB} has {len(blob)} bytes, COMMIT says {commit['nbytes']}")
    if hashlib.sha256(blob).hexdigest() != commit["sha256"]:
        raise CorruptCheckpointError(f"{path}: {LEGACY_BLOB} does not match the sha256 in COMMIT")
    arrays = {}
    for e in index["leaves"]:
        raw = blob[e["offset"] : e["offset"] + e["nbytes"]]
        arrays[e["key"]] = np.frombuffer(raw, dtype=stored_dtype(e["dtype"])).reshape(e["shape"]).copy()
    keys = list(arrays) if template is None else flatten_with_keys(template)[0]
    leaves = [arrays[k] for k in keys]
    per_leaf = shardings_per_leaf(shardings, template, len(keys))
    if per_leaf is not None:
        leaves = [jax.make_array_from_callback(a.shape, s, lambda idx, a=a: a[idx]) for a, s in
                  zip(leaves, per_leaf, strict=True)]
    if template is None:
        return dict(zip(keys, leaves, strict=True)), index["metadata"]
    return jax.tree_util.tree_unflatten(flatten_with_keys(template)[2], leaves), index["metadata"]


def convert_legacy(run_path: str) -> list[int]:
    """Rewrite every committed checkpoint of the earlier single-blob format under ``run_path`` in
    the sharded format (in place: the new one is committed before the old blob is deleted)."""
    store = TierStore(f"{run_path.rstrip('/')}/{CHECKPOINT_DIR}", PERMANENT)
    converted = []
    for step in store.committed_steps():
        path = store.url(step)
        commit = read_commit(path)
        if commit is None or not is_legacy(commit):
            continue
        flat, meta = restore_legacy(path, commit, None, None)
        index = read_index(path)
        tmp = f"{path}.converting"
        keys = [e["key"] for e in index["leaves"]]
        write_staged(stage_leaves(tmp, keys, [flat[k] for k in keys], meta, step=step))
        fs, root = fsspec.core.url_to_fs(path)
        delete_dir(fs, root)
        fs.mv(fsspec.core.url_to_fs(tmp)[1], root, recursive=True)
        converted.append(step)
    return converted
