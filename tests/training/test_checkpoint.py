"""Checkpoint atomicity, retention and round trips (local disk and an S3-compatible server)."""

import json

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
    blob = tmp_path / "checkpoints" / "step-00000003" / "arrays.bin"
    blob.write_bytes(blob.read_bytes()[:10])  # a kill -9 during a copy
    with caplog.at_level("WARNING", logger="marin.training.checkpoint"):
        step, tree, meta = mgr.restore_latest(template=_state())
    assert step == 2 and meta == {"data_step": 2}
    _assert_same(tree, _state(2))
    assert "checkpoint at step 3 does not verify" in caplog.text and "has 10 bytes" in caplog.text
    [aside] = [p.name for p in (tmp_path / "checkpoints").iterdir() if ".corrupt-" in p.name]
    assert aside.startswith("step-00000003.corrupt-") and (tmp_path / "checkpoints" / aside / "arrays.bin").exists()
    assert mgr.committed_steps() == [1, 2]
    # the one set aside is not retention's business, and a structural mismatch is not "corruption"
    mgr.save(4, _state(4), {"data_step": 4})
    mgr.save(5, _state(5), {"data_step": 5})
    assert (tmp_path / "checkpoints" / aside).exists()
    bad = _state()
    bad["params"]["w"] = jnp.zeros((4, 4))
    with pytest.raises(ckpt.CheckpointMismatchError):
        mgr.restore_latest(template=bad)
    assert mgr.committed_steps() == [2, 4, 5]


def test_crash_mid_write_leaves_nothing_complete(tmp_path, monkeypatch):
    mgr = CheckpointManager(str(tmp_path), CheckpointPolicy(every_steps=1, keep_last=3))
    mgr.save(1, _state(1), {"data_step": 1})

    real_commit = ckpt._commit

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("simulated kill before COMMIT")

    monkeypatch.setattr(ckpt, "_commit", crash)
    with pytest.raises(KeyboardInterrupt):
        mgr.save(2, _state(2), {"data_step": 2})
    monkeypatch.setattr(ckpt, "_commit", real_commit)

    # The half-written step 2 exists on disk but does not look complete to anyone.
    assert (tmp_path / "checkpoints" / "step-00000002" / "arrays.bin").exists()
    assert mgr.committed_steps() == [1]
    assert CheckpointManager(str(tmp_path), mgr.policy).latest_step() == 1
    with pytest.raises(FileNotFoundError):
        read_checkpoint(mgr.path_for(2))
    # A corrupted blob under a valid COMMIT is detected, not silently loaded.
    blob = tmp_path / "checkpoints" / "step-00000001" / "arrays.bin"
    data = bytearray(blob.read_bytes())
    data[0] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(OSError, match="sha256"):
        read_checkpoint(mgr.path_for(1))
    # The next save replaces the leftover and garbage-collects it.
    mgr.save(2, _state(2), {"data_step": 2})
    assert mgr.committed_steps() == [1, 2]


def test_retention_keep_last_and_permanent(tmp_path):
    mgr = CheckpointManager(str(tmp_path), CheckpointPolicy(every_steps=1, keep_last=2, keep_every=4))
    tiny = {"x": jnp.zeros((1,))}
    for step in range(1, 11):
        mgr.save(step, tiny, {})
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
    mgr.save(2, _state(2), {"data_step": 2})
    fresh = CheckpointManager(out, mgr.policy)
    assert fresh.committed_steps() == [2]
    restored, meta = fresh.restore(2, template=_state())
    _assert_same(restored, _state(2))
    assert meta["data_step"] == 2
    commit = json.loads(fresh.fs.cat_file(f"{fresh.root}/step-00000002/COMMIT"))
    assert commit["step"] == 2
