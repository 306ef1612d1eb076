"""In-training task evaluation on a mesh that spans two JAX processes: each process tokenizes the
task, builds the same rows and scores its own shards; the record equals the standalone eval step's
result for the same checkpoint, scored in one process on the same (1, 8) mesh."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from marin.evaluation.suite import TASK_KEY
from marin.inference.evaluate import EvalConfig, run_eval
from marin.pools import with_device_count
from marin.training.metrics import read_metrics

HOST = Path(__file__).with_name("two_process_task_host.py")
REPO = HOST.parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_process_in_training_task_record_equals_the_eval_step(tmp_path, eval_store, eval_task):
    out = tmp_path / "run"
    coord = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = with_device_count(env.get("XLA_FLAGS", ""), None)
    procs = [subprocess.Popen([sys.executable, str(HOST), str(out), str(p), coord, eval_store, eval_task], env=env,
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for p in range(2)]
    done = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in done]
    assert all("RESULT " in stdout for stdout, _ in done)

    records = read_metrics(str(out), kind="eval")
    assert [r["step"] for r in records] == [2, 4]
    assert all("eval/macro_bpb" not in r for r in records)  # tasks only: no eval sets, no held-out split
    result = run_eval(EvalConfig(str(out), "", checkpoint="all", pool="local-cpu-ep8",
                                 tasks={"k40_domains": eval_task}), use_ray=False)
    assert [c["step"] for c in result["checkpoints"]] == [2, 4]
    for rec, ck in zip(records, result["checkpoints"]):
        task = ck["tasks"]["k40_domains"]
        assert rec[TASK_KEY.format(name="k40_domains", metric="acc")] == task["acc"]
        assert rec[TASK_KEY.format(name="k40_domains", metric="acc_norm")] == task["acc_norm"]
        assert rec[TASK_KEY.format(name="k40_domains", metric="gold_bpb")] == pytest.approx(task["gold_bpb"], rel=1e-5)
    # both processes wrote their own shards of each checkpoint: the weights were split across them
    parts = sorted(p.name for p in (out / "checkpoints" / "step-00000004" / "parts").iterdir())
    assert parts == ["process-00000.json", "process-00001.json"]
