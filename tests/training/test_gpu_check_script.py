"""benchmarks/gpu_check.py keeps its JSON contract (run with --cpu-smoke on a tiny model; slow: each
case compiles in its own process), and says so clearly when jax sees no GPU."""

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
@pytest.mark.timeout(1800)  # 20 cases, each its own compile: 476 s at a load of 13-30 on 2 cores; the default is 600 s
def test_cpu_smoke_json_contract():
    """Every transport x grouped implementation x optimizer (the fixed transport once per optimizer):
    on CPU capacity runs and fits its plan; ragged_dot and tokamax's XLA path are the dense fallback
    there, so each either runs within its plan or is refused by the pre-step check in its one line."""
    out = subprocess.run([sys.executable, SCRIPT, "--cpu-smoke", "--budget-s", "1700"], env=_env(),
                         capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["mode"] == "cpu-smoke" and result["errors"] == {}
    expected = {f"fixed/-/{o}" for o in ("adamw", "muonh")} | {
        f"{t}/{i}/{o}" for t in ("ragged_capacity", "ragged", "dropless") for i in ("capacity", "ragged_dot", "tokamax")
        for o in ("adamw", "muonh")}
    assert set(result["cases"]) == expected
    assert result["gpu_mfu"] > 0 and result["stack"]["jax"]
    for case, r in result["cases"].items():
        transport, impl, optimizer = case.split("/")
        assert (r["transport"], r["grouped_impl"], r["optimizer"]) == (transport, impl, optimizer)
        if impl in ("-", "capacity"):
            assert r["fits"], r["refused"]
        if r["fits"]:
            assert result["tokens_per_s"][case] > 0 and r["loss"] > 0 and r["step_s"] > 0
            mem = result["planner_vs_measured_memory"][case]
            assert mem["planned_bytes"] > 0 and mem["measured_bytes"] > 0
            assert 0.5 < mem["ratio"] < 2.0, mem
        else:
            line = result["refused"][case]
            assert "\n" not in line and f"grouped_impl {impl}" in line
            assert line.endswith("try parallelism.grouped_impl='capacity'")
    assert result["refused"], "the dense fallback of ragged_dot on CPU is refused somewhere"


def test_without_a_gpu_it_says_so():
    env = {**_env(), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert "jax sees no GPU" in result["error"] and result["cases"] == {}
