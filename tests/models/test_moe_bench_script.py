"""benchmarks/moe_bench.py runs end to end at a toy size and keeps its output contract (slow: ~1 min)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_moe_bench_prints_table_and_json():
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "_MARIN_REEXECED", "XLA_FLAGS")}
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "moe_bench.py"), "--d-model", "128", "--experts", "8",
         "--tokens", "1024", "--reps", "1", "--no-small", "--no-large"],
        env=env, capture_output=True, text=True, timeout=600, check=True)
    lines = out.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    for key in ("moe_vs_dense_1dev", "moe_vs_dense_ep8", "moe_vs_onehot_1dev", "norouting_vs_dense_1dev", "cpu_mfu",
                "expert_gemm_gflops_kernel", "expert_gemm_gflops_xla_batched", "expert_gemm_gflops_xla_dense2d"):
        assert result[key] > 0, key
    assert result["cpu_grouped_gemm_kernel"] is True  # the measured MoE block ran marin's CPU kernel
    assert result["host_malloc_tuned"] is True  # the script restarted itself with marin.runtime's settings
    assert any("same matmuls, no routing" in line for line in lines)
