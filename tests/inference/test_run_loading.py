"""Which checkpoint a reader of a run (sample, eval, export, harness) uses when the newest is damaged:
the newest that verifies, named in one warning line; a damaged one asked for by step is refused in
one line naming the step to pass instead. Real checkpoints on disk, damaged the way a kill during a
copy or a bad disk damages them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from marin.inference.run import RunLoadError, load_verified_checkpoint
from marin.training.checkpoint import CheckpointManager, CheckpointPolicy, committed_steps, restore_checkpoint


def _run(tmp_path: Path, steps=(2, 4, 6)) -> Path:
    mgr = CheckpointManager(str(tmp_path), CheckpointPolicy(every_steps=1, keep_last=10))
    for s in steps:
        mgr.save(s, {"w": np.full((64,), s, np.float32)}, {"step": s}, blocking=True)
    return tmp_path


def _load(run: Path):
    return lambda s: restore_checkpoint(f"{run}/checkpoints/step-{s:08d}")[0]["['w']"]


def _flip_a_byte(run: Path, step: int) -> None:
    chunk = next(p for p in (run / "checkpoints" / f"step-{step:08d}" / "arrays").rglob("*")
                 if p.is_file() and p.name != "zarr.json")
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))


def _drop_part_record(run: Path, step: int) -> None:
    (run / "checkpoints" / f"step-{step:08d}" / "parts" / "process-00000.json").unlink()


def test_the_newest_checkpoint_that_verifies_is_used_and_the_damaged_ones_named(tmp_path, caplog):
    run = _run(tmp_path)
    _flip_a_byte(run, 6)
    _drop_part_record(run, 4)
    with caplog.at_level("WARNING", logger="marin.inference.run"):
        step, w = load_verified_checkpoint(str(run), None, _load(run))
    assert step == 2 and np.all(w == 2)
    (line,) = caplog.messages
    assert line.startswith(f"checkpoint {run}/checkpoints/step-00000006 is damaged (['w'] does not read back: ")
    assert "Digest mismatch" in line
    assert (f"checkpoint {run}/checkpoints/step-00000004 is damaged (part parts/process-00000.json (process 0 of 1) "
            "is missing or unreadable (FileNotFoundError)) and was skipped") in line
    assert line.endswith("; using step 2, the newest checkpoint that verifies")
    # a reader leaves the run as it found it (training moves damaged checkpoints aside; readers do not)
    assert committed_steps(str(run)) == [2, 4, 6]


def test_a_damaged_checkpoint_asked_for_by_step_is_refused_naming_the_one_before(tmp_path):
    run = _run(tmp_path)
    _flip_a_byte(run, 6)
    with pytest.raises(RunLoadError) as e:
        load_verified_checkpoint(str(run), 6, _load(run), flag="--checkpoint")
    assert str(e.value).startswith(f"checkpoint {run}/checkpoints/step-00000006 is damaged (['w'] does not read back")
    assert str(e.value).endswith("; pass --checkpoint 4 for the one before it") and "\n" not in str(e.value)
    assert load_verified_checkpoint(str(run), 4, _load(run))[0] == 4


def test_no_checkpoint_that_verifies_no_checkpoint_and_no_directory_are_one_line_each(tmp_path):
    run = _run(tmp_path / "run", steps=(2,))
    _flip_a_byte(run, 2)
    with pytest.raises(RunLoadError, match=r"^no checkpoint of .* verifies: checkpoint .*step-00000002 is damaged"):
        load_verified_checkpoint(str(run), None, _load(run))
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunLoadError, match="empty has no committed checkpoint"):
        load_verified_checkpoint(str(tmp_path / "empty"), None, _load(run))
    with pytest.raises(RunLoadError) as e:
        load_verified_checkpoint(str(tmp_path / "nope"), None, _load(run))
    assert str(e.value).startswith(f"no such directory: {tmp_path}/nope ")
    with pytest.raises(RunLoadError, match=r"no committed checkpoint at step 3; committed: \[2\]"):
        load_verified_checkpoint(str(run), 3, _load(run))


def test_the_pool_falls_back_together_when_one_process_saw_damage(tmp_path, caplog):
    """Each process reads only its own slices: a checkpoint whose damage one host alone saw is
    skipped by every host (the vote stands in for the pool's all-gather)."""
    run = _run(tmp_path)
    votes = []

    def vote(ok: bool) -> bool:  # this process read cleanly; another process of the pool did not at step 6
        votes.append(ok)
        return ok and len(votes) > 1

    with caplog.at_level("WARNING", logger="marin.inference.run"):
        step, _ = load_verified_checkpoint(str(run), None, _load(run), agree=vote)
    assert step == 4 and votes == [True, True]
    assert "step-00000006 is damaged (another process of the pool could not read its part)" in caplog.text
    json.loads((run / "checkpoints" / "step-00000006" / "COMMIT").read_text())  # untouched


@pytest.mark.slow  # two JAX processes joined by jax.distributed
def test_the_eval_steps_vote_is_false_on_every_process_when_one_saw_damage(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        coord = f"127.0.0.1:{s.getsockname()[1]}"
    host = Path(__file__).with_name("two_process_vote.py")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [subprocess.Popen([sys.executable, str(host), str(p), coord], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env) for p in (0, 1)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    results = [json.loads(next(line for line in o.splitlines() if line.startswith("RESULT "))[7:]) for o in outs]
    assert results == [[False, True], [False, True]]  # process 1's damage fails the vote on process 0 too


def test_a_reader_requests_its_pools_devices_beside_the_xla_flags_already_set(monkeypatch):
    """`marin sample` / `eval` ask for the run's fake devices before JAX starts: an XLA_FLAGS that holds
    other flags keeps them and gains the pool's count; a device count the user set is left alone."""
    from marin.inference.run import prepare_devices
    from marin.pools import get_pool

    monkeypatch.delitem(sys.modules, "jax")  # as in a fresh `marin sample` process, which has not imported it
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/hlo")
    prepare_devices(get_pool("local-cpu"))
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/hlo --xla_force_host_platform_device_count=8"
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    prepare_devices(get_pool("local-cpu"))
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"
