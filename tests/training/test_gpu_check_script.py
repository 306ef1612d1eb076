"""benchmarks/gpu_check.py keeps its JSON contract (run with --cpu-smoke on a tiny model; slow: each
transport compiles in its own process), and says so clearly when jax sees no GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "benchmarks" / "gpu_check.py")


def _env():
    return {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "GLIBC_TUNABLES")}


@pytest.mark.slow
def test_cpu_smoke_json_contract():
    out = subprocess.run([sys.executable, SCRIPT, "--cpu-smoke"], env=_env(), capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["mode"] == "cpu-smoke" and result["errors"] == {}
    assert set(result["transports"]) == {"fixed", "dropless", "ragged", "ragged_capacity"}
    assert result["gpu_mfu"] > 0
    for t in ("fixed", "dropless", "ragged", "ragged_capacity"):
        assert result["tokens_per_s"][t] > 0 and result["transports"][t]["loss"] > 0
        mem = result["planner_vs_measured_memory"][t]
        assert mem["planned_bytes"] > 0 and mem["measured_bytes"] > 0
        assert 0.5 < mem["ratio"] < 2.0, mem


def test_without_a_gpu_it_says_so():
    env = {**_env(), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert "jax sees no GPU" in result["error"] and result["transports"] == {}
