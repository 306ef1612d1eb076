"""A real ``marin run`` on an S3 prefix rides out a store outage: the local S3 server is stopped while a
step runs (the lease heartbeats fail and are retried) and started again; the step's SUCCESS is
recorded and nothing is marked failed."""

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


@pytest.mark.slow  # about 60 s: a 15 s outage, then s3fs reconnecting
def test_marin_run_on_s3_rides_out_a_store_outage(restartable_s3, tmp_path):
    exp = tmp_path / "exp.py"
    exp.write_text(EXPERIMENT)
    started, go = tmp_path / "started", tmp_path / "go"
    env = env_for(tmp_path, TEST_STARTED=str(started), TEST_GO=str(go), MARIN_STORAGE_RETRY_S="120")
    proc = subprocess.Popen([sys.executable, "-m", "marin.cli", "run", str(exp), "--prefix", "s3://outage/run",
                             "--progress", "false", "--lease_ttl", "8"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env, start_new_session=True)
    deadline = time.time() + 120
    while not started.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert started.exists(), proc.communicate(timeout=30)
    restartable_s3.stop()
    time.sleep(15)  # past s3fs's own few seconds of retries: the lease renewals fail and are retried
    restartable_s3.start()
    go.touch()
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    # the outage was met by the one retry policy, logged, and ridden out
    assert "/.executor_lease failed (EndpointConnectionError: Could not connect to the endpoint URL" in err, err
    assert "attempt 1, retrying in 0.5s (giving up 120s after the first failure)" in err
    assert "/.executor_lease succeeded again after " in err
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    (step_dir,) = fs.glob("s3://outage/run/wait-*")
    record = json.loads(fs.cat_file(f"{step_dir}/.executor_status"))
    assert record["status"] == "SUCCESS"
    assert [e["status"] for e in record["events"]] == ["RUNNING", "SUCCESS"]
