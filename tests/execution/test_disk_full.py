"""A step that fills the disk: the failure and its cause are recorded and shown, other outputs are intact.

A real ``marin run`` on a real 4 MiB filesystem (a tmpfs mounted in a private mount namespace:
``unshare -rm`` works as root and, where the kernel allows user namespaces, without root) whose
second step writes until the disk is full. Without the space the run holds back, the FAILED record
itself could not be written and the step would read as interrupted with no reason."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EXPERIMENT = textwrap.dedent(
    '''
    import dataclasses, os
    from marin.execution import ExecutorStep, executor_main, this_output_path, versioned

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        out: str
        n: int
        after: str | None = None  # the finished step's output: makes it an upstream

    def small(cfg):
        with open(os.path.join(cfg.out, "result.txt"), "w") as f:
            f.write("finished\\n")

    def fill(cfg):
        with open(os.path.join(cfg.out, "big.bin"), "wb") as f:
            while os.environ.get("TEST_FILL") == "1":
                f.write(bytes(65536))
                f.flush()
            f.write(b"fits now")

    if __name__ == "__main__":
        a = ExecutorStep("small", small, Cfg(this_output_path(), versioned(1)))
        executor_main(steps=[a, ExecutorStep("fill", fill, Cfg(this_output_path(), versioned(2), a.cd("result.txt")))])
    '''
)

# inside the namespace: mount, run (the disk fills), keep what a person would look at, free space, rerun
SCRIPT = textwrap.dedent(
    '''
    set -u
    mount -t tmpfs -o size=4m tmpfs "$STORE" || exit 90
    run() { "$PY" -m marin.cli run "$EXP" --prefix "$STORE" --progress false --max_concurrent 1 "$@"; }
    TEST_FILL=1 run > "$OUT/run1.out" 2> "$OUT/run1.err"; echo $? > "$OUT/run1.rc"
    "$PY" -m marin.cli status --prefix "$STORE" > "$OUT/status.out" 2>&1
    cp "$STORE"/fill-*/.executor_status "$OUT/fill_status.json"
    cp "$STORE"/small-*/.executor_status "$OUT/small_status.json"
    cp "$STORE"/small-*/result.txt "$OUT/small_result.txt"
    ls -a "$STORE" > "$OUT/store.ls"
    rm "$STORE"/fill-*/big.bin
    TEST_FILL=0 run --retry_failed fill > "$OUT/run2.out" 2> "$OUT/run2.err"; echo $? > "$OUT/run2.rc"
    cp "$STORE"/fill-*/big.bin "$OUT/fill_result.bin"
    '''
)


def _namespace_problem() -> str | None:
    if not shutil.which("unshare"):
        return "no unshare(1) on this machine"
    r = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                       capture_output=True, text=True)
    if r.returncode:
        return ("mounting a small filesystem needs root or unprivileged user namespaces, and this machine "
                f"allows neither (unshare -rm mount: {r.stderr.strip()[:200]})")
    return None


def test_a_full_disk_records_the_cause_and_keeps_the_other_outputs(tmp_path):
    problem = _namespace_problem()
    if problem:
        pytest.skip(problem)
    exp = tmp_path / "exp.py"
    exp.write_text(EXPERIMENT)
    store, out = tmp_path / "store", tmp_path / "out"
    store.mkdir()
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": REPO, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
           "STORE": str(store), "OUT": str(out), "EXP": str(exp), "PY": sys.executable}
    r = subprocess.run(["unshare", "-rm", "sh", "-c", SCRIPT], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    err = (out / "run1.err").read_text()
    assert (out / "run1.rc").read_text().strip() == "1", err
    # the driver says what happened, where, and what to do
    hint = "free space, then rerun with --retry_failed fill"
    line = next(x for x in err.splitlines() if x.startswith("FAILED fill "))
    assert f"disk full: No space left on device (the step's output directory {store}/fill-" in line, err
    assert "free of 4.0 MiB); " + hint + " (OSError: [Errno 28] No space left on device)" in line
    assert "could not record" not in err and "Traceback (most recent call last)" not in err, err
    # ... and so does the record, for status, show and the report
    record = json.loads((out / "fill_status.json").read_text())
    assert record["status"] == "FAILED"
    assert record["events"][-1]["message"].startswith("disk full: No space left on device") and hint in \
        record["events"][-1]["message"]
    assert record["info"]["error"] == record["events"][-1]["message"]
    status = (out / "status.out").read_text()
    assert [x.split()[:3] for x in status.splitlines() if x.startswith(("fill ", "small "))] == \
        [["fill", record["info"]["hash"], "FAILED"], ["small", json.loads((out / "small_status.json").read_text())
                                                      ["info"]["hash"], "SUCCESS"]], status
    # the finished step is intact, and the space held back was given back at the end of the run
    assert json.loads((out / "small_status.json").read_text())["status"] == "SUCCESS"
    assert (out / "small_result.txt").read_text() == "finished\n"
    assert not [n for n in (out / "store.ls").read_text().split() if n.startswith(".tmp-")]
    # the hint works: with space freed, the failed step alone runs again and succeeds
    err2 = (out / "run2.err").read_text()
    assert (out / "run2.rc").read_text().strip() == "0", err2
    assert "Steps: 1 cached, 1 succeeded" in err2
    assert (out / "fill_result.bin").read_bytes() == b"fits now"


RESERVE_SCRIPT = textwrap.dedent(
    '''
    import errno, json, os, sys
    from marin.execution import storage

    store = sys.argv[1]
    out = {}

    def fill():
        with open(f"{store}/filler", "ab", buffering=0) as f:
            try:
                while True:
                    f.write(bytes(4096))
            except OSError as e:
                assert e.errno == errno.ENOSPC

    def write(name, text="x" * 20_000):
        try:
            storage.write_text(f"{store}/{name}", text)
            return "written"
        except OSError as e:
            return errno.errorcode[e.errno]

    with storage.space_reserved(store, 128 << 10):
        out["reserve_files"] = [n for n in os.listdir(store) if n.startswith(".tmp-reserve-")]
        fill()
        with storage.sparing_reserve():
            out["sparing"] = write("renewal")
        out["record"] = write("record")  # spends one 64 KiB slice
        out["second"] = write("second")  # fits in what the first slice left
        fill()
        out["third"] = write("third")  # the last slice
        fill()
        out["spent"] = write("fourth")
    out["left_after"] = [n for n in os.listdir(store) if n.startswith(".tmp")]
    print(json.dumps(out))
    '''
)


def _run_on_a_one_mib_disk(store, script: str) -> subprocess.CompletedProcess:
    """``script`` run by Python with ``store`` (created here) as its argument, a 1 MiB tmpfs mounted
    there in a mount namespace of its own; skips the test where no namespace can be made."""
    problem = _namespace_problem()
    if problem:
        pytest.skip(problem)
    store.mkdir()
    mount_then_run = 'mount -t tmpfs -o size=1m tmpfs "$1" && exec "$2" -c "$3" "$1"'
    return subprocess.run(["unshare", "-rm", "sh", "-c", mount_then_run, "sh", str(store), sys.executable, script],
                          env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=60)


def test_the_space_held_back_is_spent_by_records_a_slice_at_a_time_and_given_back(tmp_path):
    store = tmp_path / "store"
    r = _run_on_a_one_mib_disk(store, RESERVE_SCRIPT)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["reserve_files"]) == 1
    assert out["sparing"] == "ENOSPC"  # a lease renewal leaves the space to the records
    assert (out["record"], out["second"], out["third"]) == ("written",) * 3
    assert out["spent"] == "ENOSPC"  # held back space is bounded: once spent, writes fail as before
    assert out["left_after"] == []


@pytest.mark.parametrize("size, fill, want", [
    ("1m", "", "(the disk is full: 0 B free of 1.0 MiB"),
    ("2m", "count=20", "(the disk is nearly full: 768.0 KiB free of 2.0 MiB on {store}/experiments, less than the "
                       "1.0 MiB a run holds back for its steps' records)"),
], ids=["full", "nearly-full"])
def test_a_disk_already_full_is_refused_up_front_in_one_line(tmp_path, size, fill, want):
    """A full disk at the start is found by the prefix check, before Ray starts, not by a traceback
    from the first record write (an empty probe file would still be created on a full disk); so is
    one too full to hold back the space for the records (the first lease write failed there)."""
    problem = _namespace_problem()
    if problem:
        pytest.skip(problem)
    exp = tmp_path / "exp.py"
    exp.write_text(EXPERIMENT)
    store = tmp_path / "store"
    store.mkdir()
    script = (f'mount -t tmpfs -o size={size} tmpfs "$STORE" || exit 90; dd if=/dev/zero of="$STORE/filler" bs=64k '
              f'{fill} 2>/dev/null; "$PY" -m marin.cli run "$EXP" --prefix "$STORE" --progress false; rc=$?; '
              'find "$STORE" -mindepth 1 >&2; exit $rc')
    env = {**os.environ, "PYTHONPATH": REPO, "RAY_USAGE_STATS_ENABLED": "0", "STORE": str(store), "EXP": str(exp),
           "PY": sys.executable}
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    error, *left = r.stderr.splitlines()
    assert error.startswith(f"marin: error: cannot write under the prefix {store} {want.format(store=store)}"), error
    assert sorted(left) == [f"{store}/experiments", f"{store}/filler"]  # nothing half-written


LEASE_SCRIPT = textwrap.dedent(
    '''
    import os, sys
    from marin.execution import lease

    step_dir = sys.argv[1] + "/step-abc"
    os.makedirs(step_dir)
    with open(sys.argv[1] + "/filler", "ab", buffering=0) as f:
        try:
            while True:
                f.write(bytes(4096))
        except OSError:
            pass
    try:
        lease.try_acquire(step_dir, "holder-1")
    except lease.LeaseWriteDiskFull as e:
        print(e)
    print(sorted(os.listdir(step_dir)))
    '''
)


def test_a_lease_write_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path):
    """Mid-run, once the space held back is spent, the next step's lease write finds the disk full:
    the run ends in one line (the step never started, so there is nothing of it to record)."""
    store = tmp_path / "store"
    r = _run_on_a_one_mib_disk(store, LEASE_SCRIPT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        f"cannot start {store}/step-abc: disk full: No space left on device writing its lease (0 B free of 1.0 MiB "
        "there); free space and rerun", "[]"]
