"""Checkpoint atomicity, retention and round trips (local disk, an S3-compatible server, a GCS
emulator), sharded restores onto other meshes, and the earlier single-blob format."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin.training import checkpoint as ckpt
from marin.training.checkpoint import CheckpointManager, CheckpointPolicy, read_checkpoint, write_checkpoint


def _state(seed: int = 0):
    rng = np.random.default_rng(seed)
    return {
        "params": {"w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32), "b": jnp.arange(4, dtype=jnp.bfloat16)},
        "opt": (jnp.zeros((2,), jnp.float32), {"count": jnp.asarray(7, jnp.int32)}),
        "rng": jnp.asarray([1, 2], jnp.uint32),
    }


def _assert_same(a, b):
    import jax

    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def _chunk_files(ckpt_dir: Path) -> list[Path]:
    """The data chunks of a checkpoint (largest first), not its metadata records."""
    files = [p for p in (ckpt_dir / "arrays").rglob("*") if p.is_file() and p.name != "zarr.json"]
    return sorted(files, key=lambda p: -p.stat().st_size)


def test_roundtrip_bitwise(tmp_path):
    state = _state()
    write_checkpoint(str(tmp_path / "c"), state, {"data_step": 12}, step=12)
    restored, meta = read_checkpoint(str(tmp_path / "c"), template=state)
    _assert_same(state, restored)
    assert meta == {"data_step": 12}
    flat, _ = read_checkpoint(str(tmp_path / "c"))
    assert set(flat) == {"['params']['w']", "['params']['b']", "['opt'][0]", "['opt'][1]['count']", "['rng']"}


def test_template_mismatch_is_an_error(tmp_path):
    write_checkpoint(str(tmp_path / "c"), _state(), {}, step=1)
    bad = _state()
    bad["params"]["w"] = jnp.zeros((4, 4))
    bad["params"]["extra"] = jnp.zeros((2,))
    del bad["rng"]
    with pytest.raises(ckpt.CheckpointMismatchError) as err:
        read_checkpoint(str(tmp_path / "c"), template=bad)
    msg = str(err.value)
    assert "(3 of 5 leaves differ)" in msg
    assert "['params']['w']: checkpoint float32[3, 4], model wants float32[4, 4]" in msg
    assert "['params']['extra']: missing from the checkpoint (model wants float32[2])" in msg
    assert "['rng']: in the checkpoint (uint32[2]) but not in the model" in msg
    assert "\n" not in msg


def test_restore_latest_skips_a_truncated_checkpoint_and_moves_it_aside(tmp_path, caplog):
    mgr = CheckpointManager(str(tmp_path), CheckpointPolicy(every_steps=1, keep_last=3))
    for step in (1, 2, 3):
        mgr.save(step, _state(step), {"data_step": step})
    mgr.wait()
    chunk = _chunk_files(tmp_path / "checkpoints" / "step-00000003")[0]
    chunk.write_bytes(chunk.read_bytes()[:10])  # a kill -9 during a copy
    with caplog.at_level("WARNING", logger="marin.training.checkpoint"):
        step, tree, meta = mgr.restore_latest(template=_state())
    assert step == 2 and meta == {"data_step": 2}
    _assert_same(tree, _state(2))
    assert "checkpoint at step 3 does not verify" in caplog.text and "does not read back" in caplog.text
    [aside] = [p.name for p in (tmp_path / "checkpoints").iterdir() if ".corrupt-" in p.name]
    assert aside.startswith("step-00000003.corrupt-") and (tmp_path / "checkpoints" / aside / "COMMIT").exists()
    assert mgr.committed_steps() == [1, 2]
    # the one set aside is not retention's business, and a structural mismatch is not "corruption"
    mgr.save(4, _state(4), {"data_step": 4})
    mgr.save(5, _state(5), {"data_step": 5}, blocking=True)
    assert (tmp_path / "checkpoints" / aside).exists()
    bad = _state()
    bad["params"]["w"] = jnp.zeros((4, 4))
    with pytest.raises(ckpt.CheckpointMismatchError):
        mgr.restore_latest(template=bad)
    assert mgr.committed_steps() == [2, 4, 5]


def test_crash_mid_write_leaves_nothing_complete(tmp_path, monkeypatch):
    mgr = CheckpointManager(str(tmp_path), CheckpointPolicy(every_steps=1, keep_last=3))
    mgr.save(1, _state(1), {"data_step": 1}, blocking=True)

    real_commit = ckpt.save._commit

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("simulated kill before COMMIT")

    monkeypatch.setattr(ckpt.save, "_commit", crash)
    with pytest.raises(KeyboardInterrupt):
        mgr.save(2, _state(2), {"data_step": 2})
        mgr.wait()
    monkeypatch.setattr(ckpt.save, "_commit", real_commit)

    # The half-written step 2 exists on disk but does not look complete to anyone.
    assert _chunk_files(tmp_path / "checkpoints" / "step-00000002")
    assert mgr.committed_steps() == [1]
    assert CheckpointManager(str(tmp_path), mgr.policy).latest_step() == 1
    with pytest.raises(FileNotFoundError):
        read_checkpoint(mgr.path_for(2))
    # A corrupted chunk under a valid COMMIT is detected, not silently loaded.
    chunk = _chunk_files(tmp_path / "checkpoints" / "step-00000001")[0]
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(ckpt.CorruptCheckpointError, match="Digest mismatch"):
        read_checkpoint(mgr.path_for(1))
    # The next save replaces the leftover and garbage-collects it.
    mgr.save(2, _state(2), {"data_step": 2}, blocking=True)
    assert mgr.committed_steps() == [1, 2]


def test_retention_keep_last_and_permanent(tmp_path):
    mgr = CheckpointManager(str(tmp_path), CheckpointPolicy(every_steps=1, keep_last=2, keep_every=4))
    tiny = {"x": jnp.zeros((1,))}
    for step in range(1, 11):
        mgr.save(step, tiny, {})
    mgr.wait()
    assert mgr.committed_steps() == [4, 8, 9, 10]


def test_should_save_by_steps_and_wall_time(tmp_path):
    mgr = CheckpointManager(str(tmp_path), CheckpointPolicy(every_steps=10, every_minutes=1.0))
    t0 = mgr._last_save_time
    assert not mgr.should_save(3, now=t0 + 1)
    assert mgr.should_save(10, now=t0 + 1)
    assert mgr.should_save(3, now=t0 + 61)


@pytest.mark.parametrize("store", ["s3_bucket", "gcs_bucket"])
def test_object_store_roundtrip_and_resume_discovery(store, request):
    out = f"{request.getfixturevalue(store)}/train-abc"
    mgr = CheckpointManager(out, CheckpointPolicy(every_steps=1, keep_last=1))
    mgr.save(1, _state(1), {"data_step": 1})
    mgr.save(2, _state(2), {"data_step": 2}, blocking=True)
    fresh = CheckpointManager(out, mgr.policy)
    assert fresh.committed_steps() == [2]
    restored, meta = fresh.restore(2, template=_state())
    _assert_same(restored, _state(2))
    assert meta["data_step"] == 2
    commit = json.loads(fresh.fs.cat_file(f"{fresh.root}/step-00000002/COMMIT"))
    assert commit["step"] == 2 and commit["format"] == ckpt.FORMAT
    # sharded onto a mesh straight from the store
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    placed, _ = fresh.restore(2, template=_state(), shardings=rep)
    _assert_same(placed, _state(2))


def test_restore_reshards_onto_another_mesh_bitwise(tmp_path):
    """Saved sharded (2 x 4), restored onto (8 x 1), (1 x 1) and whole into this process: same values."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = np.array(jax.devices()[:8])
    w = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    src_mesh = Mesh(devices.reshape(2, 4), ("data", "expert"))
    tree = {"w": jax.device_put(w, NamedSharding(src_mesh, P("data", "expert"))),
            "b": jax.device_put(np.arange(4, dtype=np.int32), NamedSharding(src_mesh, P()))}
    write_checkpoint(str(tmp_path / "c"), tree, {"step": 1}, step=1)
    # each shard written once: 8 chunks of w (one per device), one of the replicated b
    assert len(_chunk_files(tmp_path / "c")) == 9
    template = jax.eval_shape(lambda: tree)
    for shape, spec in (((8, 1), P("data", None)), ((1, 1), P()), ((4, 2), P(None, "expert"))):
        mesh = Mesh(devices[: shape[0] * shape[1]].reshape(shape), ("data", "expert"))
        target = {"w": NamedSharding(mesh, spec), "b": NamedSharding(mesh, P())}
        out, meta = ckpt.restore_checkpoint(str(tmp_path / "c"), template, target)
        assert out["w"].sharding == target["w"]
        assert out["w"].sharding.mesh.devices.shape == shape
        np.testing.assert_array_equal(np.asarray(out["w"]), w)
        np.testing.assert_array_equal(np.asarray(out["b"]), np.arange(4))
    whole, _ = read_checkpoint(str(tmp_path / "c"))
    np.testing.assert_array_equal(whole["['w']"], w)


def test_a_missing_process_part_is_named_and_the_previous_checkpoint_restores(tmp_path, caplog):
    mgr = CheckpointManager(str(tmp_path), CheckpointPolicy(every_steps=1, keep_last=3))
    mgr.save(1, _state(1), {"data_step": 1})
    mgr.save(2, _state(2), {"data_step": 2}, blocking=True)
    (tmp_path / "checkpoints" / "step-00000002" / "parts" / "process-00000.json").unlink()
    with pytest.raises(ckpt.CorruptCheckpointError,
                       match=r"part parts/process-00000.json \(process 0 of 1\) is missing"):
        read_checkpoint(mgr.path_for(2))
    with caplog.at_level("WARNING", logger="marin.training.checkpoint"):
        step, tree, _ = mgr.restore_latest(template=_state())
    assert step == 1
    _assert_same(tree, _state(1))


def test_a_failed_save_is_one_line_and_leaves_the_previous_checkpoint(tmp_path):
    """A store that refuses writes (a file where a directory must go stands in for a full disk)."""
    mgr = CheckpointManager(str(tmp_path), CheckpointPolicy(every_steps=1, keep_last=3))
    mgr.save(1, _state(1), {"data_step": 1}, blocking=True)
    root = tmp_path / "checkpoints"
    (root / "step-00000002").mkdir()
    (root / "step-00000002" / "arrays").write_text("not a directory")  # every chunk write fails
    mgr_path = mgr.path_for(2)
    stage = ckpt.stage(mgr_path, _state(2), {"data_step": 2}, step=2)
    with pytest.raises(ckpt.CheckpointWriteError) as err:
        ckpt.write_staged(stage)
    msg = str(err.value)
    assert "\n" not in msg and "was not committed and the previous checkpoint is intact" in msg
    assert mgr.committed_steps() == [1]
    _assert_same(mgr.restore_latest(template=_state())[1], _state(1))




@pytest.mark.parametrize("commit, abort, save_try, expected", [
    (False, None, 1, None),  # undecided
    (True, None, 1, ckpt.Verdict(True)),
    (False, {"try": 1, "reason": "parts process-00001.json did not arrive"}, 1,
     ckpt.Verdict(False, "parts process-00001.json did not arrive")),
    (False, {"try": 1, "reason": "x"}, 2, None),  # an earlier try's ABORT is not this try's verdict
    (True, {"try": 2, "reason": "x"}, 2, ckpt.Verdict(True)),  # a committed directory is the checkpoint
])
def test_the_verdict_on_a_save_is_what_its_directory_shows(commit, abort, save_try, expected):
    assert ckpt.read_verdict(commit, abort, save_try) == expected


def _two_shares(path: str, step: int, save_try: int = 1):
    """A state sharded over the 8 devices, staged here and split as two processes of a pool hold it:
    process 0 the first half of every leaf's rows, process 1 the second."""
    import dataclasses

    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    rows = NamedSharding(Mesh(np.array(jax.devices()[:8]), ("x",)), PartitionSpec("x"))
    state = {"w": jax.device_put(np.arange(64, dtype=np.float32).reshape(16, 4), rows),
             "b": jax.device_put(np.arange(16, dtype=np.int32), rows)}
    staged = ckpt.stage(path, state, {"data_step": step}, step=step, save_try=save_try)
    first = [s for s in staged.shards if s[1][0].start < 8]
    second = [s for s in staged.shards if s[1][0].start >= 8]
    assert first and second
    return (state, dataclasses.replace(staged, shards=first, num_processes=2),
            dataclasses.replace(staged, shards=second, process=1, num_processes=2))


def test_a_held_part_costs_its_save_only_and_every_process_ends_with_process_0s_verdict(tmp_path):
    """Two processes' shares of one save, written from two threads. Try 1: process 1's part record is
    held (a named pipe nobody reads yet: a write the store does not answer). Process 0 gives the save
    up after its part timeout and writes ABORT; process 1 reads that verdict while its write is still
    held, abandons it and fails with process 0's reason (not on a timeout of its own, which is minutes
    here). The held write lands later, uncommitted. Try 2 of the same step (a final save tried
    again): the earlier try's ABORT is not its verdict; process 0 commits, process 1 ends with that,
    and the checkpoint restores whole."""
    import os
    import threading
    import time

    root = tmp_path / "checkpoints" / "step-00000002"
    state, p0, p1 = _two_shares(str(root), 2)
    (root / "parts").mkdir(parents=True)
    held = root / "parts" / "process-00001.json.tmp"  # where the local store writes the part record first
    os.mkfifo(held)
    errors: dict[int, str] = {}

    def process_1(staged):
        try:
            ckpt.write_staged(staged, part_timeout_s=120, poll_s=0.05)
        except ckpt.CheckpointWriteError as e:
            errors[staged.save_try] = str(e)

    host = threading.Thread(target=process_1, args=(p1,), daemon=True)
    host.start()
    with pytest.raises(ckpt.CheckpointWriteError, match=r"parts process-00001.json did not arrive within"):
        ckpt.write_staged(p0, part_timeout_s=0.5)
    host.join(timeout=60)
    assert not host.is_alive(), "process 1 still waits on its held write"
    assert "process 0 gave it up (" in errors[1] and "parts process-00001.json did not arrive" in errors[1]
    assert "this process abandoned its unfinished writes" in errors[1] and "\n" not in errors[1]
    assert json.loads((root / "ABORT").read_text())["try"] == 1 and not (root / "COMMIT").exists()
    with open(held, "rb") as pipe:  # the store answers at last: the abandoned write lands, uncommitted
        assert json.loads(pipe.read())["process"] == 1
    deadline = time.monotonic() + 30  # the abandoned thread renames it into place
    while held.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    (root / "parts" / "process-00001.json").unlink()  # what landed is the pipe itself; not readable data

    _, p0, p1 = _two_shares(str(root), 2, save_try=2)
    host = threading.Thread(target=process_1, args=(p1,), daemon=True)
    host.start()
    ckpt.write_staged(p0, part_timeout_s=120)
    host.join(timeout=60)
    assert not host.is_alive() and 2 not in errors, errors
    tree, meta = read_checkpoint(str(root))
    assert meta["data_step"] == 2
    _assert_same(tree, state)
