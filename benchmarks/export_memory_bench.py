"""Peak host memory of `marin export` against the model's size: the streaming export should hold
about one shard plus one layer's slice whatever the number of layers.

Writes checkpoints of one model at several depths (d_model 128, 16 experts of width 512: 12.6 MiB
of float32 weights per layer), exports each in a fresh subprocess (bfloat16, 4 MiB shards) and
reads that process's own peak RSS (``VmHWM``; getrusage keeps the parent's peak across exec).
Prints one line per depth, the ratio of each peak to the shallowest one's, and a last JSON line.

    python benchmarks/export_memory_bench.py [--layers 2 8 32] [--dir /tmp/export-bench]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import subprocess
import sys
import time

CHILD = """
import json, sys
from marin.inference.export import export_checkpoint
export_checkpoint(sys.argv[1], sys.argv[2], max_shard_bytes=int(sys.argv[3]))
assert not any(m == "jax" or m.startswith("jax.") for m in sys.modules), "the export imported JAX"
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"peak_rss": int(hwm.split()[1]) * 1024}))
"""


def write_run(run_dir: str, cfg) -> None:
    import jax
    import numpy as np

    from marin.models.transformer import init_params, init_router_bias
    from marin.pools import get_pool
    from marin.training.checkpoint import step_dirname, write_checkpoint

    rng = np.random.default_rng(0)
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    params = jax.tree.map(lambda s: (rng.standard_normal(s.shape) * 0.1).astype(s.dtype), shapes)
    bias = np.zeros(init_router_bias(cfg).shape, np.float32)
    pool = dataclasses.asdict(get_pool("local-cpu-1"))  # a run's record holds its pool's spec whole
    meta = {"config": {"model": dataclasses.asdict(cfg), "pool": pool, "data": {}}, "tokens": 0}
    write_checkpoint(f"{run_dir}/checkpoints/{step_dirname(1)}", {"params": params, "router_bias": bias}, meta, step=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    ap.add_argument("--dir", default="/tmp/export-memory-bench")
    ap.add_argument("--shard-bytes", type=int, default=4 << 20)
    args = ap.parse_args()
    from marin.models.config import get_preset
    from marin.models.exported import exported_shapes

    shutil.rmtree(args.dir, ignore_errors=True)
    rows = []
    for layers in args.layers:
        cfg = get_preset("tiny", vocab_size=256, n_layers=layers, d_model=128, n_experts=16, latent_dim=128,
                         expert_width=512, expert_width_multiple=8)
        run_dir = f"{args.dir}/train-l{layers}-00000000"
        write_run(run_dir, cfg)
        weights = sum(math.prod(s) * 4 for s in exported_shapes(cfg).values())
        t = time.time()
        out = subprocess.run([sys.executable, "-c", CHILD, run_dir, f"{args.dir}/out{layers}", str(args.shard_bytes)],
                             capture_output=True, text=True, check=True)
        peak = json.loads(out.stdout.strip().splitlines()[-1])["peak_rss"]
        rows.append({"layers": layers, "weights_bytes": weights, "peak_rss": peak,
                     "seconds": round(time.time() - t, 1)})
        shutil.rmtree(run_dir)
    base = rows[0]["peak_rss"]
    for r in rows:
        r["peak_vs_shallowest"] = round(r["peak_rss"] / base, 3)
        print(f"{r['layers']:3d} layers: {r['weights_bytes'] / 2**20:6.0f} MiB of float32 weights, export peak RSS "
              f"{r['peak_rss'] / 2**20:5.0f} MiB ({r['peak_vs_shallowest']:.2f}x the shallowest), {r['seconds']} s")
    shutil.rmtree(args.dir, ignore_errors=True)
    print(json.dumps({"bench": "export_memory", "rows": rows}))


if __name__ == "__main__":
    main()
