"""marin sample and marin eval on a run whose newest checkpoint is damaged (a flipped byte in a weight
chunk, a missing part record): they use the newest checkpoint that verifies and name the damaged one
in one line; asked for the damaged one by step, they refuse in one line naming the step before it.
On a copy of the tiny run the evaluation tests train (checkpoints at 15, 30 and 40)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from marin.cli import main


@pytest.fixture()
def damaged_run(trained_run, tmp_path):
    """A copy of the trained run; the test damages its step-40 checkpoint."""
    run = tmp_path / "run"
    shutil.copytree(trained_run.output_path, run, ignore=shutil.ignore_patterns(".executor_*"))
    return run


def flip_a_weight_byte(run: Path, step: int) -> None:
    ckpt = run / "checkpoints" / f"step-{step:08d}"
    index = json.loads((ckpt / "index.json").read_text())
    leaf = next(e for e in index["leaves"] if e["key"].startswith("['params']"))  # a weight every reader reads
    chunk = max((p for p in (ckpt / leaf["array"]).rglob("*") if p.is_file() and p.name != "zarr.json"),
                key=lambda p: p.stat().st_size)
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))


SAMPLE = ["--prompt", "Council note", "--max-new-tokens", "2", "--greedy", "--pool", "local-cpu-1"]


@pytest.mark.slow  # decodes (the fallback's core is in tests/inference/test_run_loading.py)
def test_sample_on_a_run_whose_newest_checkpoint_has_a_flipped_byte(capsys, caplog, damaged_run):
    flip_a_weight_byte(damaged_run, 40)
    with caplog.at_level("WARNING", logger="marin.inference.run"):
        rc = main(["sample", str(damaged_run), *SAMPLE, "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert json.loads(out)["step"] == 30
    (line,) = caplog.messages
    assert line.startswith(f"checkpoint {damaged_run}/checkpoints/step-00000040 is damaged (['params']")
    assert "Digest mismatch" in line and line.endswith("; using step 30, the newest checkpoint that verifies")


def test_sample_refuses_a_damaged_checkpoint_asked_for_by_step(capsys, damaged_run):
    flip_a_weight_byte(damaged_run, 40)
    rc = main(["sample", str(damaged_run), *SAMPLE, "--step", "40"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"marin: error: checkpoint {damaged_run}/checkpoints/step-00000040 is damaged (['params']")
    assert err.endswith("; pass --step 30 for the one before it\n")


def test_eval_on_a_run_whose_newest_checkpoint_lost_a_part_record(capsys, caplog, damaged_run, tmp_path):
    (damaged_run / "checkpoints" / "step-00000040" / "parts" / "process-00000.json").unlink()
    task = tmp_path / "task.jsonl"
    task.write_text(json.dumps({"context": "Council note 1.", "choices": [" Vote", " zzqx"], "gold": 0}) + "\n")
    with caplog.at_level("WARNING", logger="marin.inference.run"):
        rc = main(["eval", str(damaged_run), "--task", f"toy={task}", "--pool", "local-cpu-1", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert json.loads(out)["step"] == 30
    assert caplog.messages == [
        f"checkpoint {damaged_run}/checkpoints/step-00000040 is damaged (part parts/process-00000.json (process 0 of "
        "1) is missing or unreadable (FileNotFoundError)) and was skipped; using step 30, the newest checkpoint that "
        "verifies"]
    rc = main(["eval", str(damaged_run), "--task", f"toy={task}", "--step", "40"])
    out, err = capsys.readouterr()
    assert rc == 2 and err == (
        f"marin eval: error: checkpoint {damaged_run}/checkpoints/step-00000040 is damaged (part "
        "parts/process-00000.json (process 0 of 1) is missing or unreadable (FileNotFoundError)); pass --step 30 "
        "for the one before it\n")


def test_sample_on_no_such_directory_says_so(capsys, tmp_path):
    rc = main(["sample", str(tmp_path / "nope"), "--prompt", "hi"])
    _, err = capsys.readouterr()
    assert rc == 2 and err == (f"marin: error: no such directory: {tmp_path}/nope (pass a training step's output "
                               "directory; `marin status` lists them)\n")
