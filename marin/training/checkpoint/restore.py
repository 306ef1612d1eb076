"""Restoring: each process reads only the slices its devices hold for the target sharding, so a
checkpoint written on one mesh restores onto any other; lazy leaf readers for export (no JAX).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from marin.training.checkpoint.format import (
    COMMIT_FILE,
    CheckpointMismatchError,
    CorruptCheckpointError,
    check_template,
    flatten_with_keys,
    kvstore_spec,
    one_line,
    read_commit,
    read_index,
    shardings_per_leaf,
    stored_dtype,
    verify_parts,
)

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
            raise CorruptCheckpointError(f"{path}: {key} cannot be opened: {one_line(err)}") from None
        shape = tuple(e["shape"])
        if shardings is None:
            return {(): t.read()}, math.prod(shape) * stored_dtype(e["dtype"]).itemsize
        uniq: dict[Any, Any] = {}
        for idx in shardings[n].addressable_devices_indices_map(shape).values():
            k = _index_key(idx, shape)
            if k not in uniq:
                uniq[k] = t[idx].read() if shape else t.read()
        nbytes = sum(math.prod(b - a for a, b in k) for k in uniq) * stored_dtype(e["dtype"]).itemsize
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
            raise CorruptCheckpointError(f"{path}: {key} does not read back: {one_line(err)}") from None
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
            raise CorruptCheckpointError(f"{self.path}: {self.key} does not read back: {one_line(err)}") from None
        return out if dtype is None else out.astype(dtype, copy=False)


def open_leaves(path: str, keys: list[str] | None = None) -> tuple[dict[str, LeafReader], dict[str, Any]]:
    """``({key path: LeafReader}, metadata)`` of a committed checkpoint, its records verified (COMMIT,
    every process's part, the index) but no array read yet; ``keys``: only those leaves. JAX-free."""
    import tensorstore as ts  # the train extra; records are read without it

    commit = read_commit(path)
    if commit is None:
        raise FileNotFoundError(f"{path} is not a committed checkpoint (no valid {COMMIT_FILE})")
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
            raise CorruptCheckpointError(f"{path}: {key} cannot be opened: {one_line(err)}") from None
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
        raise FileNotFoundError(f"{path} is not a committed checkpoint (no valid {COMMIT_FILE})")
    verify_parts(path, commit)
    index = read_index(path)
    entries = index["leaves"]
    if template is not None:
        check_template(path, entries, template, partial=partial)
        keys, _, treedef = flatten_with_keys(template)
    else:
        keys, treedef = [e["key"] for e in entries], None
    leaf_shardings = shardings_per_leaf(shardings, template, len(keys))
    leaves = _read_leaves(path, entries, keys, leaf_shardings)
    if treedef is None:
        return dict(zip(keys, leaves, strict=True)), index["metadata"]
    return jax.tree_util.tree_unflatten(treedef, leaves), index["metadata"]


def read_checkpoint(path: str, template: Any = None) -> tuple[Any, dict[str, Any]]:
    """Every leaf of a committed checkpoint as numpy arrays in this process; ``(tree, metadata)``.

    This reads the whole state into one process: for exports and small tests only (a training or
    evaluation process restores with :func:`restore_checkpoint` and shardings). Chunks always verify
    their checksums.
    """
    return restore_checkpoint(path, template, None)
