"""A real ``marin run`` on an S3 prefix rides out a store outage: the local S3 server is stopped while a
step runs (the lease heartbeats fail and are retried) and started again; the step's SUCCESS is
recorded and nothing is marked failed.

The step is let finish only once its lease has been renewed after the restart: the heartbeat thread
is a daemon, and a renewal still in a retry's back-off (botocore's own, up to seconds, inside each of
marin's attempts) when the driver commits and exits is cut off without its "succeeded again" line."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import fsspec
import pytest
from test_run_lifecycle import env_for

EXPERIMENT = textwrap.dedent(
    '''
    import dataclasses, os, time
    from marin.execution import ExecutorStep, executor_main, this_output_path, versioned

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        out: str
        n: int

    def work(cfg):
        open(os.environ["TEST_STARTED"], "w").close()
        while not os.path.exists(os.environ["TEST_GO"]):
            time.sleep(0.1)

    if __name__ == "__main__":
        executor_main(steps=[ExecutorStep("wait", work, Cfg(this_output_path(), versioned(1)))])
    '''
)

TTL_S = 8


def _renewed_since(fs, lease_file: str, expiry_at_least: float, deadline: float) -> bool:
    """Whether the lease's expiry reaches ``expiry_at_least`` before ``deadline``: a renewal written after
    the restart sets ``expiry`` to its own time plus the TTL, past any renewal written before the outage."""
    while time.time() < deadline:
        fs.invalidate_cache(lease_file)
        if json.loads(fs.cat_file(lease_file))["expiry"] >= expiry_at_least:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow  # about 35 s alone: a 15 s outage, then the first renewal after it
def test_marin_run_on_s3_rides_out_a_store_outage(restartable_s3, tmp_path):
    exp = tmp_path / "exp.py"
    exp.write_text(EXPERIMENT)
    started, go = tmp_path / "started", tmp_path / "go"
    env = env_for(tmp_path, TEST_STARTED=str(started), TEST_GO=str(go), MARIN_STORAGE_RETRY_S="120")
    proc = subprocess.Popen([sys.executable, "-m", "marin.cli", "run", str(exp), "--prefix", "s3://outage/run",
                             "--progress", "false", "--lease_ttl", str(TTL_S)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env, start_new_session=True)
    deadline = time.time() + 120
    while not started.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert started.exists(), proc.communicate(timeout=30)
    restartable_s3.stop()
    time.sleep(15)  # past s3fs's own few seconds of retries: the lease renewals fail and are retried
    restarted = time.time()
    restartable_s3.start()
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    (step_dir,) = fs.glob("s3://outage/run/wait-*")
    renewed = _renewed_since(fs, f"{step_dir}/.executor_lease", restarted + TTL_S, deadline=time.time() + 120)
    go.touch()
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    assert renewed, f"the lease was not renewed within 120 s of the store's restart:\n{err}"
    # the outage was met by the one retry policy, logged, and ridden out
    assert "/.executor_lease failed (EndpointConnectionError: Could not connect to the endpoint URL" in err, err
    assert "attempt 1, retrying in 0.5s (giving up 120s after the first failure)" in err
    assert "/.executor_lease succeeded again after " in err
    record = json.loads(fs.cat_file(f"{step_dir}/.executor_status"))
    assert record["status"] == "SUCCESS"
    assert [e["status"] for e in record["events"]] == ["RUNNING", "SUCCESS"]
