"""A status record that does not parse (torn, truncated) is reported as unreadable by every reader, the
executor refuses to reuse or recompute the step without --repair_records, and a repair rebuilds what is
safe; record writes are atomic, so a writer killed mid-write leaves the old record whole; and the
up-front prefix check finds a missing bucket before any record is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray.cloudpickle

from marin.execution import ExecutorError, StepStatus, storage
from marin.execution import status as st
from marin.review.explain import explain
from marin.review.steps import show, status_rows

sys.path.insert(0, os.path.dirname(__file__))
from test_executor import executions, run, step  # noqa: E402
from test_run_lifecycle import DRIVER, write_experiment  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

REPO = Path(__file__).resolve().parents[2]


def tear(step_dir: str, keep: int = 100) -> str:
    path = f"{step_dir}/.executor_status"
    storage.write_text(path, storage.read_text(path)[:keep])
    return path


def test_parse_record_says_what_is_wrong_and_what_the_readable_start_says():
    assert st.parse_record("p", None) is None
    ok = st.parse_record("p", json.dumps({"status": "SUCCESS", "events": []}, indent=1))
    assert ok["status"] == "SUCCESS"
    torn = st.parse_record("s/.executor_status", json.dumps({"status": "SUCCESS", "events": [{"x": 1}]}, indent=1)[:30])
    assert torn["status"] == "UNREADABLE" and torn["head_status"] == "SUCCESS"
    assert torn["unreadable"].startswith("record unreadable: s/.executor_status (30 bytes, not JSON (")
    assert torn["unreadable"].endswith("; its readable start says SUCCESS")
    assert st.rebuild_plan(torn)[0] == StepStatus.SUCCESS
    empty = st.parse_record("p", "")
    assert empty["unreadable"] == "record unreadable: p (0 bytes, empty file)" and empty["head_status"] is None
    assert st.rebuild_plan(empty)[0] == StepStatus.INTERRUPTED
    foreign = st.parse_record("p", '{"status": "DONE"}')
    assert "not a status record" in foreign["unreadable"] and foreign["head_status"] is None
    assert st.rebuild_plan(st.parse_record("p", '{"status": "FAILED", "ev'))[0] == StepStatus.FAILED


def test_torn_success_record_is_reported_refused_and_repaired(tmp_path, ray_local, capsys):
    log = tmp_path / "log.txt"
    a = step("probe/a", log, value=1)
    b = step("b", log, a, value=2)
    store = tmp_path / "out"
    first = run([b], store)
    a_dir = next(p for p in first.outcome if "/probe/a-" in p)
    outputs = {p: Path(p, "result.json").read_text() for p in first.outcome}
    path = tear(a_dir)

    # every reader says so, under the step's full name
    rows = {r["output_path"]: r for r in status_rows(str(store))}
    row = rows[a_dir]
    assert row["name"] == "probe/a" and row["status"] == "UNREADABLE" and row["category"] == "failed"
    assert row["advice"].startswith(f"record unreadable: {path} (100 bytes, not JSON")
    assert "--repair_records true rebuilds it as SUCCESS" in row["advice"]
    assert show(a_dir)["label"] == "UNREADABLE"

    exp = tmp_path / "exp.py"
    exp.write_text(
        "import sys\nsys.path.insert(0, %r)\nfrom test_executor import step\n"
        "from marin.execution import executor_main\n"
        "a = step('probe/a', %r, value=1)\nb = step('b', %r, a, value=2)\n"
        "if __name__ == '__main__':\n    executor_main(steps=[b])\n" % (os.path.dirname(__file__), str(log), str(log)))
    rows = {r["name"]: r for r in explain(str(exp), str(store))}
    assert rows["probe/a"]["would_run"] is False
    assert rows["probe/a"]["reasons"][0].startswith(f"record unreadable: {path}")
    assert "a run refuses to reuse or recompute it" in rows["probe/a"]["reasons"][0]
    # the CLI shows the same to a user
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.path.dirname(__file__)}"}
    r = subprocess.run([sys.executable, "-m", "marin.cli", "status", "--prefix", str(store)], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"probe/a: UNREADABLE: record unreadable: {path} (100 bytes" in r.stdout
    r = subprocess.run([sys.executable, "-m", "marin.cli", "report", "--prefix", str(store), "-o",
                        str(tmp_path / "report.html")], capture_output=True, text=True, env=env, timeout=180)
    assert r.returncode == 0, r.stderr
    html = (tmp_path / "report.html").read_text()
    assert "UNREADABLE" in html and "record unreadable: " in html

    # the executor refuses, naming the step and what a repair would do; nothing is recomputed
    before = executions(log)
    with pytest.raises(ExecutorError) as e:
        run([b], store)
    msg = str(e.value)
    assert msg.startswith("1 step(s) have a status record that cannot be read")
    assert f"probe/a ({a_dir}): record unreadable: {path}" in msg
    assert "--repair_records true would rebuild it as SUCCESS: its readable start says SUCCESS" in msg
    assert executions(log) == before
    assert {p: Path(p, "result.json").read_text() for p in first.outcome} == outputs

    # the repair rebuilds SUCCESS (outputs were complete), keeps the damaged text, recomputes nothing
    result = run([b], store, repair_records=True)
    assert set(result.outcome.values()) == {"cached"}
    assert executions(log) == before
    assert "rebuilt the record of probe/a" in capsys.readouterr().err
    record = st.read_status(a_dir)
    assert record["status"] == "SUCCESS" and record["info"]["name"] == "probe/a"
    assert "rebuilt from an unreadable record" in record["events"][-1]["message"]
    assert len(Path(path + ".unreadable").read_text()) == 100
    assert not Path(a_dir, ".executor_lease").exists()


def test_torn_record_on_s3_is_unreadable_too(s3_bucket):
    step_dir = f"{s3_bucket}/run/a-0123456789"
    storage.write_text(f"{step_dir}/.executor_status", '{\n "status": "SUCCESS",\n "events": [\n  {"sta')
    record = st.read_status(step_dir)
    assert record["status"] == "UNREADABLE" and record["head_status"] == "SUCCESS"
    (row,) = status_rows(f"{s3_bucket}/run")
    assert row["name"] == "a" and row["label"] == "UNREADABLE"


WRITER = r"""
import os, signal, sys
from marin.execution import storage
path = sys.argv[1]
real_replace = os.replace
def die(src, dst):  # the process is killed after writing the new text, before it replaces the record
    os.kill(os.getpid(), signal.SIGKILL)
os.replace = die
storage.write_text(path, '{"status": "SUCCESS", "events": []}' + " " * 100000)
"""


def test_a_writer_killed_mid_write_leaves_the_old_record_whole(tmp_path):
    step_dir = tmp_path / "a-0123456789"
    path = step_dir / ".executor_status"
    storage.write_text(str(path), json.dumps({"status": "RUNNING", "events": []}))
    r = subprocess.run([sys.executable, "-c", WRITER, str(path)], env={**os.environ, "PYTHONPATH": str(REPO)},
                       timeout=60)
    assert r.returncode == -9
    assert st.read_status(str(step_dir))["status"] == "RUNNING"  # the old record, whole
    leftovers = [p.name for p in step_dir.iterdir() if p.name.startswith(".tmp-")]
    assert len(leftovers) == 1  # the half-done write, which no reader looks at
    assert status_rows(str(tmp_path))[0]["status"] in ("RUNNING",)


def test_a_missing_bucket_is_found_by_the_prefix_check_before_ray_starts(s3_endpoint, tmp_path):
    r = subprocess.run(
        [sys.executable, "-c", DRIVER, str(write_experiment(tmp_path)), "--prefix", "s3://no-such-bucket-here/run"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines() == [
        "marin: error: cannot write under the prefix s3://no-such-bucket-here/run (the bucket 'no-such-bucket-here' "
        "does not exist or is not visible with these credentials); choose a writable --prefix or $MARIN_PREFIX"]
    assert "ray imported: False" in r.stdout
