"""Sharded, asynchronous, atomic checkpoints of a training state, written by every process in parallel.

Layout under a step's output directory::

    checkpoints/step-00000100/index.json              process 0: every leaf's key path, dtype, shape and
                                                      array directory, plus the caller's metadata
    checkpoints/step-00000100/arrays/leaf-00007/      one zarr v3 array per leaf (tensorstore); its chunks
                                                      are the leaf's shards, each with a crc32c
    checkpoints/step-00000100/parts/process-00001.json  one per process, once all of its chunks are
                                                      durable: what it wrote (chunks, bytes)
    checkpoints/step-00000100/COMMIT                  process 0, last, once every part is there
    checkpoints/step-00000100/ABORT                   process 0, instead of COMMIT, when it gives the
                                                      save up: the save's outcome for every process

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
* **One verdict per save, process 0's.** The others read it from the store (COMMIT or ABORT) rather
  than each giving up on a timeout of its own, and a process still writing when the verdict appears
  abandons its writes: saves are written one after another, so a host whose part the store held
  back would otherwise start every later save late, and a failed save would fail the ones after it.
* **Storage through tensorstore's kvstore drivers** (``file``, ``s3``, ``gcs``): the same library
  orbax-checkpoint writes arrays with (Levanter uses it directly, as here). orbax's own path handling
  does not accept ``s3://`` URLs and its commit protocol differs per backend; one explicit protocol on
  all three stores is easier to reason about and to test. Small records (index, parts, COMMIT) go
  through fsspec.

The package, by concern: :mod:`~marin.training.checkpoint.format` (layout, records, storage specs),
:mod:`~marin.training.checkpoint.save`, :mod:`~marin.training.checkpoint.restore`,
:mod:`~marin.training.checkpoint.manager` (policy, retention, resume),
:mod:`~marin.training.checkpoint.discovery` (a run's committed checkpoints) and
:mod:`~marin.training.checkpoint.loading` (a trained model). Modules of ``marin`` import from
those; the names here are for experiment files and tests.
"""

from __future__ import annotations

from marin.training.checkpoint.discovery import (
    checkpoint_path,
    checkpoint_step,
    committed_steps,
    latest_checkpoint,
    select_steps,
)
from marin.training.checkpoint.format import (
    CHECKPOINT_DIR,
    CHUNK_BYTES,
    FORMAT,
    PART_TIMEOUT_S,
    PERMANENT,
    TEMPORARY,
    CheckpointMismatchError,
    CheckpointWriteError,
    CorruptCheckpointError,
    check_template,
    chunk_shape,
    flatten_with_keys,
    kvstore_spec,
    read_commit,
    read_index,
    read_metadata,
    step_dirname,
    verify_parts,
)
from marin.training.checkpoint.loading import (
    LoadedModel,
    load_model,
    model_config_of,
    read_full_state,
)
from marin.training.checkpoint.manager import (
    CheckpointManager,
    CheckpointPolicy,
    SavesFailing,
    pin_checkpoint,
    read_pins,
    temp_checkpoint_root,
    unpin_checkpoint,
)
from marin.training.checkpoint.restore import (
    READ_AHEAD_BYTES,
    LeafReader,
    open_leaves,
    read_checkpoint,
    restore_checkpoint,
)
from marin.training.checkpoint.save import (
    Verdict,
    read_verdict,
    stage,
    stage_leaves,
    write_checkpoint,
    write_staged,
)

__all__ = [
    "CHECKPOINT_DIR",
    "CHUNK_BYTES",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointPolicy",
    "SavesFailing",
    "pin_checkpoint",
    "read_pins",
    "read_verdict",
    "unpin_checkpoint",
    "CheckpointWriteError",
    "CorruptCheckpointError",
    "FORMAT",
    "LeafReader",
    "LoadedModel",
    "PART_TIMEOUT_S",
    "PERMANENT",
    "READ_AHEAD_BYTES",
    "TEMPORARY",
    "Verdict",
    "check_template",
    "checkpoint_path",
    "checkpoint_step",
    "chunk_shape",
    "committed_steps",
    "flatten_with_keys",
    "kvstore_spec",
    "latest_checkpoint",
    "load_model",
    "model_config_of",
    "open_leaves",
    "read_checkpoint",
    "read_commit",
    "read_full_state",
    "read_index",
    "read_metadata",
    "restore_checkpoint",
    "select_steps",
    "stage",
    "stage_leaves",
    "step_dirname",
    "temp_checkpoint_root",
    "verify_parts",
    "write_checkpoint",
    "write_staged",
]
