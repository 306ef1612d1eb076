"""``marin export``: a run's weights as safetensors shards any framework can read, with a config,
the tokenizer, a numpy reference forward and a model card that says where the weights came from.

Shards are filled in file order up to ``max_shard_bytes`` (a tensor larger than that gets a shard of
its own). :func:`export_checkpoint` (the command) streams from the sharded checkpoint without JAX:
each exported tensor is one layer's slice of a stored leaf (:func:`marin.models.exported.exported_tensor`
on :class:`marin.training.checkpoint.LeafReader` views), read chunk by chunk, converted (bfloat16 by
default) and written with its shard, then let go, so a process holds about one shard plus one
layer's slice whatever the model's size (the hero's 535B parameters are 1.07 TB in bfloat16; a host
has about 960 GB). ``processes`` splits the shards over worker processes. Each shard is written
under a temporary name and renamed (one PUT on an object store) when complete, and
``export-progress.json`` lists the finished ones, so a killed export, rerun, continues where it
stopped and never leaves a shard that looks complete but is not. The index, config and card are
written last. A destination is checked before anything is written (:func:`check_destination`:
never the run, a directory holding it, or any step's output), and ``overwrite`` replaces a
non-empty one only once the new export is complete, written beside it (:func:`swap_in` says how on
each store). :func:`export_model` writes an in-memory params tree the same way (tests, notebooks).
The layout (names, shapes, ``y = x @ W``) is documented in :mod:`marin.models.exported` and docs/use.md.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import math
import multiprocessing
import os
import re
import shutil
import uuid
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import fsspec
import numpy as np

from marin.data.tokenizer import tokenizer_json_path
from marin.evaluation.sets import run_tokenizer_path
from marin.execution.experiment_record import experiment_record_paths, read_experiment_record
from marin.execution.failures import disk_full_error
from marin.execution.plan import CREDENTIALS_HELP, url_credentials_masked
from marin.execution.status import STATUS_FILE
from marin.inference.run import RunLoadError, committed_run_steps, load_verified_checkpoint
from marin.models import numpy_forward
from marin.models.config import count_params
from marin.models.exported import (
    CONFIG_FILE,
    INDEX_FILE,
    config_record,
    exported_shapes,
    exported_tensor,
    to_export_dtype,
)
from marin.textfmt import format_bytes
from marin.training.checkpoint.format import read_index
from marin.training.checkpoint.loading import model_config_of
from marin.training.checkpoint.restore import open_leaves
from marin.training.run import Run

DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
DEFAULT_DTYPE = "bfloat16"
CARD_FILE = "README.md"
REFERENCE_FILE = "reference_forward.py"
PROGRESS_FILE = "export-progress.json"
PARTIAL_SUFFIX = ".partial"


class ExportError(ValueError):
    """An export that would overwrite something, or cannot be written."""


def plan_shards(shapes: dict[str, tuple[int, ...]], max_shard_bytes: int, itemsize: int = 4) -> list[list[str]]:
    """Tensor names per shard: file order, each shard at most ``max_shard_bytes`` unless a single
    tensor is larger (then it is alone). Pure."""
    if max_shard_bytes < 1:
        raise ExportError(f"max shard size must be positive, got {max_shard_bytes}")
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        n = itemsize
        for s in shape:
            n *= s
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def marin_version() -> str:
    try:
        return version("marin")
    except PackageNotFoundError:
        return "unknown"


def check_output_dir(out_dir: str, overwrite: bool, source: str | None = None) -> str:
    """Where :func:`export_model` writes (local disk): ``out_dir`` when it is new or empty, its staging
    sibling when ``overwrite`` replaces what is there (swapped in by :func:`swap_in` once complete)."""
    if os.path.isfile(out_dir):
        raise ExportError(f"{out_dir} is a file: give a directory to export into")
    check_destination(out_dir, source)
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        if not overwrite:
            raise ExportError(f"{out_dir} is not empty: choose a new directory or pass --overwrite to replace it")
        staging = sibling(out_dir, STAGING_SUFFIX)
        if os.path.isdir(staging):
            shutil.rmtree(staging)
        return staging
    return out_dir


def export_model(params, router_bias, cfg, out_dir: str, *, tokenizer_path: str | None = None,
                 lineage: dict[str, Any] | None = None, overwrite: bool = False,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict[str, Any]:
    """Write an export directory; returns ``{"dir", "shards", "tensors", "total_size"}``. A non-empty
    ``out_dir`` is replaced (``overwrite``) only once the new export is complete: see :func:`swap_in`."""
    final_dir = out_dir
    out_dir = check_output_dir(out_dir, overwrite, (lineage or {}).get("run_dir"))
    os.makedirs(out_dir, exist_ok=True)
    shapes = exported_shapes(cfg)
    plan = plan_shards(shapes, max_shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for k, names in enumerate(plan, start=1):
        fname = f"model-{k:05d}-of-{len(plan):05d}.safetensors"
        tensors = {n: exported_tensor(params, router_bias, cfg, n) for n in names}
        write_safetensors(out_dir, fname, tensors)
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update({n: fname for n in names})
        del tensors
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    lineage = lineage or {}
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(config_record(cfg, marin_version=marin_version(), lineage=lineage), f,
                  indent=1)
    if tokenizer_path:
        with fsspec.open(tokenizer_json_path(tokenizer_path), "rb") as src, \
                open(os.path.join(out_dir, "tokenizer.json"), "wb") as dst:
            dst.write(src.read())
    shutil.copyfile(numpy_forward.__file__, os.path.join(out_dir, REFERENCE_FILE))
    with open(os.path.join(out_dir, CARD_FILE), "w") as f:
        f.write(model_card(cfg, lineage, len(plan), total))
    if out_dir != final_dir:
        swap_in(out_dir, final_dir)
    return {"dir": final_dir, "shards": len(plan), "tensors": len(shapes), "total_size": total}


# ---- streaming from a checkpoint -------------------------------------------------------------------
class ExportInterrupted(ExportError):
    """An earlier export into the same directory, of another checkpoint or with other options."""


def file_mode() -> int:
    """The mode an ordinary new file gets here (0666 less the umask): safetensors' writer creates
    its file 0600, unlike every other file of an export."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _is_local(fs: Any) -> bool:
    from fsspec.implementations.local import LocalFileSystem  # the class only, to tell local disk apart

    return isinstance(fs, LocalFileSystem)


def write_safetensors(out_dir: str, fname: str, tensors: dict[str, np.ndarray]) -> int:
    """Write one shard so that it appears only complete: on local disk under a temporary name, then
    renamed; on an object store as one PUT (a multipart upload is visible only once finished).
    Returns the file's size in bytes."""
    from safetensors.numpy import save, save_file  # safetensors: the train extra, only when writing

    fs, root = fsspec.core.url_to_fs(out_dir)
    final = f"{root.rstrip('/')}/{fname}"
    if _is_local(fs):
        tmp = f"{root.rstrip('/')}/.{fname}{PARTIAL_SUFFIX}"
        with _removed_on_failure(tmp):
            save_file(tensors, tmp, metadata={"format": "np"})
            os.chmod(tmp, file_mode())
            os.replace(tmp, final)
        return os.path.getsize(final)
    data = save(tensors, metadata={"format": "np"})
    fs.pipe_file(final, data)
    return len(data)


def _put_text(fs: Any, path: str, text: str) -> None:
    """One small file, atomically (rename on local disk, one PUT on an object store)."""
    if _is_local(fs):
        tmp = f"{path}{PARTIAL_SUFFIX}"
        with _removed_on_failure(tmp):
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)
    else:
        fs.pipe_file(path, text.encode("utf-8"))


@contextlib.contextmanager
def _removed_on_failure(tmp: str):
    """A temporary file that a failed write (a full disk, a kill) must not leave behind half-written."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def is_disk_full(e: BaseException) -> bool:
    """Whether a write failed for want of space: an ``ENOSPC``/``EDQUOT`` OSError anywhere in the
    chain, or safetensors' writer's error, which carries only the OS's text ("os error 28")."""
    if disk_full_error(e) is not None:
        return True
    return type(e).__name__ == "SafetensorError" and re.search(r"os error (28|122)\b", str(e)) is not None


def _disk_size(out_dir: str) -> str:
    """`` (N in all)`` for a local destination, for a disk-full message (what is free now says
    nothing: the failed file was removed)."""
    try:
        return f" ({format_bytes(shutil.disk_usage(out_dir).total)} in all)"
    except OSError:
        return ""


def refuse_credentials(out_dir: str) -> None:
    """Refuse a destination URL that carries credentials, without echoing them (they would reach the
    terminal, the store client's errors and the export's own records)."""
    shown = url_credentials_masked(out_dir)
    if shown is not None:
        raise ExportError(f"-o {shown} has credentials in it (the part before '@'); {CREDENTIALS_HELP}")



# ---- replacing an export: check first, replace last ---------------------------------------------------
STAGING_SUFFIX = ".export-partial"
"""An export that replaces a non-empty directory is written into ``.{name}.export-partial`` beside it."""
REPLACED_SUFFIX = ".export-replaced"
"""Where the directory being replaced is moved, on local disk, for the moment of the swap."""


def _place(url: str) -> tuple[str, str]:
    """``(filesystem, absolute path)`` of a location, to compare two of them: a local path resolved
    (symlinks and ``..`` included), a URL as its store's path without a trailing ``/``."""
    fs, root = fsspec.core.url_to_fs(url)
    if _is_local(fs):
        return "file", os.path.realpath(root)
    return type(fs).__name__, root.rstrip("/")


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def sibling(out_dir: str, suffix: str) -> str:
    """``out_dir``'s hidden sibling ``.{name}{suffix}``, on the same store (a rename on local disk
    stays on one filesystem); an export directory without a parent (a bucket) cannot be replaced."""
    fs, root = fsspec.core.url_to_fs(out_dir)
    root = root.rstrip("/")
    parent, _, name = root.rpartition("/")
    if not name or not parent:
        raise ExportError(f"cannot replace {out_dir}: it has no parent directory to write the new export beside it")
    where = f"{parent}/.{name}{suffix}"
    return where if _is_local(fs) else f"{out_dir.split('://', 1)[0]}://{where}"


def check_destination(out_dir: str, source: str | None = None) -> None:
    """Refuse, in one line and before anything is read or written, a destination whose replacement
    would destroy more than an export: one that is, contains or lies inside ``source`` (the run being
    exported), or is, contains or lies inside any step's output (a directory holding a step record).
    Only what exists is looked at: a destination's step outputs by walking it (a step's record sits
    at the top of its directory, so a prefix of runs is refused at its first run), its parents by
    one lookup each."""
    fs, root = fsspec.core.url_to_fs(out_dir)
    root = root.rstrip("/")
    kind, out = _place(out_dir)
    if source is not None:
        src_kind, src = _place(source)
        if src_kind == kind and _within(out, src):
            where = "is" if out == src else "lies inside"
            raise ExportError(f"-o {out_dir} {where} the run being exported ({source}): export it to a directory of "
                              "its own")
        if src_kind == kind and _within(src, out):
            raise ExportError(f"-o {out_dir} contains the run being exported ({source}): replacing it would delete "
                              "the run; export it to a directory of its own")
    try:
        parent = root
        while "/" in parent.strip("/"):
            parent = parent.rsplit("/", 1)[0]
            if fs.isfile(f"{parent}/{STATUS_FILE}"):
                raise ExportError(f"-o {out_dir} lies inside the output of a step ({_url_of(out_dir, parent)}): "
                                  "export to a directory of its own")
        if fs.isdir(root):
            for folder, _, files in fs.walk(root):
                if STATUS_FILE in files:
                    which = "is" if folder.rstrip("/") == root else "contains"
                    raise ExportError(f"-o {out_dir} {which} the output of a step ({_url_of(out_dir, folder)}): "
                                      "an export never replaces a step's outputs; choose another directory")
    except ExportError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to look (a store without credentials) is one answer
        raise ExportError(f"cannot write the export to {out_dir}: {storage_reason(e)}") from None


def _url_of(like: str, path: str) -> str:
    """A store path written as ``like`` is (a URL keeps its scheme)."""
    return f"{like.split('://', 1)[0]}://{path.rstrip('/')}" if "://" in like else path.rstrip("/")


def swap_in(staging: str, out_dir: str) -> None:
    """Put the complete export in ``staging`` in ``out_dir``'s place, replacing what was there.

    On local disk: ``out_dir`` is renamed aside (``.{name}.export-replaced``), ``staging`` renamed
    to ``out_dir``, then the old one deleted: two renames, so ``out_dir`` is always either the whole
    old export or the whole new one (a crash between them leaves both, under their sibling names).
    An object store has no rename of a directory (nor an atomic one of a file), so the replacement
    is file by file: the old index is deleted first (without it the directory never reads as a
    complete export, see :func:`marin.models.load_exported`), each new file is copied in by the
    store (a server-side copy), the new index last, then the old files the new export does not have
    and the staging copy are deleted. Until the index's copy the old export's files are in place
    less its index; a swap cut short is redone by rerunning the export."""
    fs, src = fsspec.core.url_to_fs(staging)
    _, dst = fsspec.core.url_to_fs(out_dir)
    src, dst = src.rstrip("/"), dst.rstrip("/")
    if _is_local(fs):
        aside = sibling(out_dir, REPLACED_SUFFIX)
        if os.path.lexists(aside):
            shutil.rmtree(aside)
        exists = os.path.lexists(dst)
        if exists:
            os.rename(dst, aside)
        os.rename(src, dst)
        if exists:
            shutil.rmtree(aside)
        return
    new = sorted((p[len(src) + 1:] for p in fs.find(src)), key=lambda rel: rel == INDEX_FILE)
    old = [p for p in fs.find(dst)] if fs.isdir(dst) else []
    if fs.isfile(f"{dst}/{INDEX_FILE}"):
        fs.rm_file(f"{dst}/{INDEX_FILE}")
    for rel in new:
        fs.copy(f"{src}/{rel}", f"{dst}/{rel}")
    keep = {f"{dst}/{rel}" for rel in new}
    for p in old:
        if p not in keep:
            fs.rm_file(p)
    fs.rm(src, recursive=True)


_KEY_PART = re.compile(r"\['([^']*)'\]")


def model_readers(checkpoint: str) -> tuple[Any, dict[str, Any], Any, dict[str, Any]]:
    """``(cfg, params, router_bias, metadata)`` of a committed checkpoint directory with every array a
    lazy :class:`marin.training.checkpoint.LeafReader` (nothing read yet, no JAX): ``params`` has the
    model's nesting (``params["blocks"]["wq"][3]`` is layer 3's slice), so
    :func:`marin.models.exported.exported_tensor` cuts exported tensors from it as from arrays."""
    keys = [e["key"] for e in read_index(checkpoint)["leaves"]]
    wanted = [k for k in keys if k.startswith("['params']") or k == "['router_bias']"]
    readers, meta = open_leaves(checkpoint, wanted)
    params: dict[str, Any] = {}
    for key, reader in readers.items():
        parts = _KEY_PART.findall(key)
        if parts[0] != "params":
            continue
        node = params
        for p in parts[1:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = reader
    if "['router_bias']" not in readers:
        raise ExportError(f"{checkpoint} holds no router bias: it is not a marin MoE training checkpoint")
    return model_config_of(meta), params, readers["['router_bias']"], meta


@functools.lru_cache(maxsize=2)
def _cached_readers(checkpoint: str) -> tuple[Any, dict[str, Any], Any, dict[str, Any]]:
    return model_readers(checkpoint)  # a worker writes several shards of one checkpoint


@dataclasses.dataclass(frozen=True)
class ShardJob:
    """One shard of a streaming export: which tensors, from which checkpoint, to which file."""

    checkpoint: str
    out_dir: str
    fname: str
    names: tuple[str, ...]
    dtype: str


def write_shard(job: ShardJob) -> int:
    """Read, convert and write one shard (the unit a worker process does); returns the file's size.
    Host memory: the shard's converted tensors plus one tensor in float32 and the chunks under it."""
    cfg, params, bias, _ = _cached_readers(job.checkpoint)
    tensors = {}
    for n in job.names:
        tensors[n] = to_export_dtype(exported_tensor(params, bias, cfg, n), job.dtype)
    return write_safetensors(job.out_dir, job.fname, tensors)


def shard_names(plan: list[list[str]]) -> list[str]:
    return [f"model-{k:05d}-of-{len(plan):05d}.safetensors" for k in range(1, len(plan) + 1)]


def export_estimate(cfg, entries: list[dict[str, Any]], *, dtype: str, max_shard_bytes: int, processes: int,
                    remote: bool) -> dict[str, int]:
    """What a streaming export will write and hold: ``shards``, ``bytes`` (the tensors), and
    ``host_bytes``, the peak host memory of its processes together: per process one shard of
    converted tensors (a remote destination serializes it once more before its PUT), the largest
    tensor once in float32, and the largest stored chunk under it (a reader decodes whole chunks).
    Pure, from the config and the checkpoint index's leaf table."""
    itemsize = np.dtype(np.float32).itemsize if dtype == "float32" else 2
    shapes = exported_shapes(cfg)
    plan = plan_shards(shapes, max_shard_bytes, itemsize)
    sizes = {n: math.prod(s) * itemsize for n, s in shapes.items()}
    biggest_shard = max(sum(sizes[n] for n in names) for names in plan)
    biggest_f32 = max(math.prod(s) * 4 for s in shapes.values())
    chunk = max((math.prod(e.get("chunk") or e["shape"]) * 4 for e in entries
                 if e["key"].startswith("['params']")), default=0)
    per_process = biggest_shard * (2 if remote else 1) + biggest_f32 + chunk
    return {"shards": len(plan), "tensors": len(shapes), "bytes": sum(sizes.values()),
            "host_bytes": per_process * max(1, min(processes, len(plan)))}


def prepare_output(out_dir: str, overwrite: bool) -> str:
    """Check the destination before any weight is read and return where to write: ``out_dir`` when
    it is new, empty or holds an unfinished export (continued); its staging sibling
    (:func:`sibling`) when ``overwrite`` replaces a non-empty one, which stays as it is until the new
    export is complete (:func:`swap_in`). Not a file, and writable (a probe file is written and
    removed). Raises :class:`ExportError` in one line; deletes nothing."""
    fs, root = fsspec.core.url_to_fs(out_dir)
    root = root.rstrip("/")
    try:
        if fs.isfile(root):
            raise ExportError(f"{out_dir} is a file: give a directory to export into")
        present = fs.ls(root, detail=False) if fs.isdir(root) else []
        resumable = any(p.rstrip("/").endswith(f"/{PROGRESS_FILE}") for p in present)
        if present and not resumable and not overwrite:
            raise ExportError(f"{out_dir} is not empty: choose a new directory or pass --overwrite to replace it")
        target = sibling(out_dir, STAGING_SUFFIX) if present and overwrite else out_dir
        troot = fsspec.core.url_to_fs(target)[1].rstrip("/")
        fs.makedirs(troot, exist_ok=True)
        probe = f"{troot}/.marin-export-write-check"
        fs.pipe_file(probe, b"")
        fs.rm_file(probe)
        return target
    except ExportError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure here (a read-only disk, a store without credentials) is one answer
        raise ExportError(f"cannot write the export to {out_dir}: {storage_reason(e)}") from None


def storage_reason(e: BaseException) -> str:
    """One line of why a store refused: the OS's reason, or the error's first line and its type."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _read_progress(fs: Any, root: str) -> dict[str, Any] | None:
    try:
        return json.loads(fs.cat_file(f"{root}/{PROGRESS_FILE}"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def export_checkpoint(run_dir: str, out_dir: str, *, step: int | None = None, dtype: str = DEFAULT_DTYPE,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, processes: int = 1, overwrite: bool = False,
                      say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Stream a run's committed checkpoint (``step``; None: the newest that verifies) into an export
    directory (local, ``s3://``, ``gs://``) without JAX; returns ``{"dir", "step", "shards", "tensors",
    "total_size", "resumed"}``. ``processes`` > 1 writes the shards from that many worker processes.
    An unfinished export of the same checkpoint and options in ``out_dir`` is continued.

    Checks first, replaces last: the run is looked up (it exists, it has the committed checkpoint)
    and the destination checked (:func:`check_destination`: never the run, a directory holding it
    or any step's output) before anything is written; with ``overwrite`` a non-empty ``out_dir`` is
    kept as it is while the new export is written beside it, and swapped in only once complete
    (:func:`swap_in`), so a failed export leaves the old one intact and a rerun continues it."""
    to_export_dtype(np.zeros(0, np.float32), dtype)  # an unknown dtype is refused before anything else
    if processes < 1:
        raise ExportError(f"--processes must be at least 1, got {processes}")
    refuse_credentials(out_dir)
    steps = committed_run_steps(run_dir)  # the source first: a mistyped run is refused before -o is touched
    if step is not None and step not in steps:
        raise RunLoadError(f"{run_dir} has no committed checkpoint at step {step}; committed: {steps}")
    check_destination(out_dir, run_dir)
    target = prepare_output(out_dir, overwrite)
    invocation = uuid.uuid4().hex
    try:
        res = load_verified_checkpoint(
            run_dir, step, lambda s: _export_step(run_dir, s, target, dtype, max_shard_bytes, processes, invocation,
                                                  staging=target != out_dir),
            say=say)[1]
        if target != out_dir:
            swap_in(target, out_dir)
        return {**res, "dir": out_dir}
    except Exception as e:
        if not is_disk_full(e):
            raise
        raise ExportError(f"cannot write the export to {out_dir}: the disk filled up{_disk_size(out_dir)}; free "
                          "space, then rerun the same command: it continues from the shards already written (no "
                          "file is left half-written)") from None


def _export_step(run_dir: str, step: int, out_dir: str, dtype: str, max_shard_bytes: int, processes: int,
                 invocation: str, staging: bool = False) -> dict[str, Any]:
    """Write the export of checkpoint ``step`` into ``out_dir``; ``staging``: ``out_dir`` is the
    staging sibling of a replacement, whose content other than an unfinished export of the same
    checkpoint and options (continued) is this command's own to delete."""
    ckpt = Run(run_dir).checkpoint_path(step)
    cfg, _, _, meta = model_readers(ckpt)  # records verified (a missing part fails here, before any write)
    fs, root = fsspec.core.url_to_fs(out_dir)
    root = root.rstrip("/")
    itemsize = 4 if dtype == "float32" else 2
    shapes = exported_shapes(cfg)
    plan = plan_shards(shapes, max_shard_bytes, itemsize)
    fnames = shard_names(plan)
    identity = {"checkpoint": absolute_run_dir(ckpt), "step": step, "dtype": dtype,
                "max_shard_bytes": max_shard_bytes, "shards": len(plan)}
    progress = _read_progress(fs, root)
    done: dict[str, int] = {}
    resumed = False
    if progress is not None and {k: progress.get(k) for k in identity} == identity:
        present = {p.rstrip("/").rsplit("/", 1)[-1]: p for p in fs.ls(root, detail=False)}
        done = {f: n for f, n in (progress.get("done") or {}).items()
                if f in present and fs.size(present[f]) == n}
        resumed = bool(done)
    elif staging and fs.isdir(root) and fs.ls(root, detail=False):  # an earlier replacement's, other options
        for p in fs.ls(root, detail=False):
            fs.rm(p, recursive=True)
    elif progress is not None and progress.get("invocation") != invocation:
        raise ExportInterrupted(
            f"{out_dir} holds an unfinished export of step {progress.get('step')} ({progress.get('dtype')}, "
            f"shards of {progress.get('max_shard_bytes')} bytes): rerun with those options to continue it, or pass "
            "--overwrite to start over")
    elif progress is not None:  # this very command's, of a checkpoint found damaged on the way: start over
        for p in fs.ls(root, detail=False):
            fs.rm(p, recursive=True)
    if _is_local(fs):  # a killed writer's temporary files: never complete, never listed in the progress
        for p in fs.ls(root, detail=False):
            if p.endswith(PARTIAL_SUFFIX):
                fs.rm_file(p)
    record = {"format": "marin-export-progress-v1", **identity, "invocation": invocation, "done": done}

    def finished(fname: str, size: int) -> None:
        done[fname] = size
        _put_text(fs, f"{root}/{PROGRESS_FILE}", json.dumps(record, indent=1))

    _put_text(fs, f"{root}/{PROGRESS_FILE}", json.dumps(record, indent=1))
    jobs = [ShardJob(ckpt, out_dir, f, tuple(names), dtype) for f, names in zip(fnames, plan, strict=True)
            if f not in done]
    if processes == 1 or len(jobs) <= 1:
        for job in jobs:
            finished(job.fname, write_shard(job))
    else:
        # spawn, not fork: the parent's tensorstore and fsspec threads do not survive a fork
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(min(processes, len(jobs)), mp_context=ctx) as pool:
            futures = {pool.submit(write_shard, job): job for job in jobs}
            for f in concurrent.futures.as_completed(futures):
                finished(futures[f].fname, f.result())
    weight_map = {n: f for f, names in zip(fnames, plan, strict=True) for n in names}
    total = sum(math.prod(s) * itemsize for s in shapes.values())
    lineage = checkpoint_lineage(run_dir, step, meta)
    _put_text(fs, f"{root}/{CONFIG_FILE}",
              json.dumps(config_record(cfg, dtype, marin_version=marin_version(), lineage=lineage), indent=1))
    tok = run_tokenizer_path((meta.get("config") or {}).get("data") or {})
    if tok:
        with fsspec.open(tokenizer_json_path(tok), "rb") as src:
            _put_text(fs, f"{root}/tokenizer.json", src.read().decode("utf-8"))
    with open(numpy_forward.__file__, encoding="utf-8") as src:
        _put_text(fs, f"{root}/{REFERENCE_FILE}", src.read())
    _put_text(fs, f"{root}/{CARD_FILE}", model_card(cfg, lineage, len(plan), total, dtype))
    # the index last: its presence is what says the export is complete
    _put_text(fs, f"{root}/{INDEX_FILE}",
              json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    fs.rm_file(f"{root}/{PROGRESS_FILE}")
    return {"dir": out_dir, "step": step, "shards": len(plan), "tensors": len(shapes), "total_size": total,
            "resumed": resumed}


def run_lineage(run) -> dict[str, Any]:
    """Where a :class:`marin.inference.LoadedRun`'s weights come from (see :func:`checkpoint_lineage`)."""
    return checkpoint_lineage(run.run_dir, run.step, run.metadata)


def absolute_run_dir(run_dir: str) -> str:
    """``run_dir`` as an absolute location: a local path made absolute, a URL as given (no trailing /)."""
    run_dir = run_dir.rstrip("/")
    return run_dir if "://" in run_dir else os.path.abspath(run_dir)


def checkpoint_lineage(run_dir: str, step: int, metadata: dict[str, Any]) -> dict[str, Any]:
    """Where a checkpoint's weights come from: step name and hash, experiment, data, tokens, evaluations.
    ``metadata``: the checkpoint's (its config record, tokens)."""
    run_dir = absolute_run_dir(run_dir)
    base = os.path.basename(run_dir)
    name, _, step_hash = base.rpartition("-")
    run = Run(run_dir)
    info = run.info or {}
    record = metadata.get("config") or {}
    data = record.get("data") or {}
    lineage: dict[str, Any] = {
        "run_dir": run_dir, "step_name": info.get("name") or name or base, "step_hash": step_hash or None,
        "experiment": _experiment_of(run_dir, info), "checkpoint_step": step,
        "train_tokens": int(metadata.get("tokens", 0)), "preset": record.get("preset"),
        "pool": record.get("pool"), "data": data if "stores" in data else {"synthetic": data},
    }
    try:
        evals = run.metrics("eval")
    except (FileNotFoundError, OSError):
        evals = []
    if evals:
        last = evals[-1]
        lineage["eval"] = {k: v for k, v in last.items() if k.startswith("eval/") or k in ("step", "tokens")}
    return lineage


def _experiment_of(run_dir: str, info: dict[str, Any]) -> str | None:
    """``script: description`` of the newest experiment record under ``{prefix}/experiments`` that
    lists this step, or None for a run started outside the executor. Paths are compared absolute, so a
    record written with a relative ``--prefix`` (or a run named by one) is still found."""
    suffix = f"/{info.get('name')}-{run_dir.rpartition('-')[2]}"  # output path = {prefix}/{name}-{hash}
    if not info.get("name") or not run_dir.endswith(suffix):
        return None
    prefix = run_dir[: -len(suffix)]
    found = []
    for path in experiment_record_paths(prefix):
        rec = read_experiment_record(path)
        if isinstance(rec, dict) and any(absolute_run_dir(s.get("output_path") or "") == run_dir
                                         for s in rec.get("steps", []) if isinstance(s, dict)):
            found.append(rec)
    if not found:
        return None
    rec = max(found, key=lambda r: r.get("updated") or 0)
    return f"{rec.get('script')}: {rec.get('description')}" if rec.get("description") else rec.get("script")


def model_card(cfg, lineage: dict[str, Any], shards: int, total: int, dtype: str = "float32") -> str:
    c = count_params(cfg)
    lines = [
        f"# {lineage.get('step_name') or 'marin model'}",
        "",
        "A mixture-of-experts transformer trained with marin. No transformers architecture matches it exactly "
        "(latent-compressed routed experts, a sigmoid router balanced by a per-expert bias), so the tensors are "
        "documented below and `reference_forward.py` (numpy + safetensors only) runs it:",
        "",
        "    python reference_forward.py . 1 2 3",
        "",
        "or, with marin installed, `marin.models.load_exported(DIR)` gives JAX params with the run's logits.",
        "",
        "## Lineage",
        "",
        f"- training step: `{lineage.get('step_name')}` hash `{lineage.get('step_hash')}` ({lineage.get('run_dir')})",
        f"- experiment: {lineage.get('experiment') or 'not recorded'}",
        f"- checkpoint step: {lineage.get('checkpoint_step')}, training tokens: {lineage.get('train_tokens', 0):,}",
        f"- data: {json.dumps(lineage.get('data'))}",
        f"- preset: {lineage.get('preset')}, pool: {(lineage.get('pool') or {}).get('name')}",
    ]
    ev = lineage.get("eval")
    if ev:
        lines += ["", "## Evaluation (last in-training eval)", ""]
        lines += [f"- {k}: {v:.4f}" if isinstance(v, float) else f"- {k}: {v}" for k, v in ev.items()]
    lines += [
        "",
        "## Model",
        "",
        f"- {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads ({cfg.n_kv_heads} kv), head_dim "
        f"{cfg.head_dim}, vocab {cfg.vocab_size}, context {cfg.max_seq_len}",
        f"- attention: sliding window {cfg.sliding_window}, every {cfg.global_every}th layer and the last global",
        f"- MoE: {cfg.n_shared_experts} shared experts (width {cfg.shared_width}), {cfg.n_experts} routed experts "
        f"(width {cfg.expert_width}, top-{cfg.top_k}) in a latent space of {cfg.latent_dim}",
        f"- parameters: {c['total_params']:,} total, {c['active_params']:,} active per token",
        f"- files: {shards} safetensors shard(s), {total:,} bytes of {dtype} tensors",
        "",
        "## Tensors (y = x @ W)",
        "",
        "| name | shape |",
        "|---|---|",
    ]
    shapes = exported_shapes(cfg)
    for name, shape in shapes.items():
        if name.startswith("layers.") and not name.startswith("layers.0."):
            continue
        lines.append(f"| `{name.replace('layers.0.', 'layers.{i}.')}` | {list(shape)} |")
    return "\n".join(lines) + "\n"


def export_run(run, out_dir: str, *, overwrite: bool = False,
               max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict[str, Any]:
    """Export a :class:`marin.inference.LoadedRun` (its tokenizer and lineage included)."""
    tok = run.tokenizer
    return export_model(run.params, run.router_bias, run.cfg, out_dir, tokenizer_path=tok.path if tok else None,
                        lineage=run_lineage(run), overwrite=overwrite, max_shard_bytes=max_shard_bytes)
