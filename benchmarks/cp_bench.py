"""Context parallelism on CPU fake devices: one long sequence, the whole train step at C = 1, 2, 4.

    python benchmarks/cp_bench.py [--seq-len 8192] [--degrees 1,2,4] [--reps 3]

For each C, one sequence of ``--seq-len`` tokens trains on a (1, C) mesh of fake CPU devices (C = 1:
one device holds the whole sequence), a 2-layer model (one sliding-window layer with a window of
512, one global layer; 4 heads over 2 KV heads locally and 1 globally, blocked attention, the
"local" expert transport), the same total length every time. Reports XLA's per-device memory of the
compiled step (arguments + outputs + temporaries, from ``memory_analysis``: what one device must
hold) and the best step time of ``--reps``; ratios against C = 1 from the same run. Fake CPU devices
share this machine's cores, so the step-time ratio shows the cost of the halo and gather work
and the layout change, not a speed-up. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import time

DEVICES = 4
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={DEVICES}").strip()

import jax  # noqa: E402  (after the fake device count)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from marin.models.config import get_preset  # noqa: E402
from marin.parallel.mesh import batch_sharding, make_mesh, place_host_arrays  # noqa: E402
from marin.training.config import (  # noqa: E402
    ParallelismConfig,
    SyntheticDataConfig,
    TelemetryConfig,
    TrainConfig,
    model_at,
)
from marin.training.trainer import (  # noqa: E402
    build_train_step,
    init_host_state,
    model_config,
    state_shardings,
    synthetic_batch,
)

MODEL = {"vocab_size": 512, "d_model": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "n_kv_heads_global": 1,
         "head_dim": 64, "sliding_window": 512, "attention_impl": "blocked", "attention_block": 512,
         "latent_dim": 128, "n_experts": 4, "top_k": 2, "expert_width": 128, "shared_width": 128,
         "transport": "local"}


def measure(seq_len: int, degree: int, reps: int) -> dict:
    config = TrainConfig(output_path="", data=SyntheticDataConfig(vocab_size=512), model=get_preset("tiny", **MODEL),
                         preset="tiny", tokens_per_step=seq_len, seq_len_phases=((0.0, seq_len),),
                         telemetry=TelemetryConfig(wandb_project=None),
                         parallelism=ParallelismConfig(
                             context_parallel_by_seq_len=((seq_len, degree),) if degree > 1 else ()))
    cfg = model_at(config, model_config(config), seq_len)
    mesh = make_mesh(1, degree)
    host = init_host_state(config, cfg)
    shardings = state_shardings(host, mesh)
    step = build_train_step(config, cfg, mesh, "local", shardings)
    b = synthetic_batch(config.data, 0, 1, seq_len)
    batch = place_host_arrays((b["tokens"], b["segment_ids"]), batch_sharding(mesh, degree))
    lr = jnp.float32(1e-3)
    state = place_host_arrays(host, shardings)
    compiled = step.lower(state, *batch, lr).compile()
    mem = compiled.memory_analysis()
    per_device = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
    state, m = compiled(state, *batch, lr)  # warm
    jax.block_until_ready(m)
    best = float("inf")
    for _ in range(reps):
        state = place_host_arrays(host, shardings)
        t = time.perf_counter()
        _, m = compiled(state, *batch, lr)
        jax.block_until_ready(m)
        best = min(best, time.perf_counter() - t)
    return {"context_parallel": degree, "seq_len": seq_len, "peak_bytes_per_device": int(per_device),
            "temp_bytes_per_device": int(mem.temp_size_in_bytes), "step_s": best, "loss": float(m["loss"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--degrees", default="1,2,4")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    rows = [measure(args.seq_len, int(c), args.reps) for c in args.degrees.split(",")]
    base = rows[0]
    print(f"one sequence of {args.seq_len:,} tokens, whole train step, {len(jax.devices())} fake CPU devices")
    print(f"{'C':>3} {'MiB/device':>11} {'vs C=1':>7} {'step s':>8} {'vs C=1':>7} {'loss':>8}")
    for r in rows:
        r["memory_ratio"] = r["peak_bytes_per_device"] / base["peak_bytes_per_device"]
        r["step_time_ratio"] = r["step_s"] / base["step_s"]
        print(f"{r['context_parallel']:>3} {r['peak_bytes_per_device'] / 2**20:>11.1f} {r['memory_ratio']:>7.2f} "
              f"{r['step_s']:>8.3f} {r['step_time_ratio']:>7.2f} {r['loss']:>8.4f}")
    # the same step: the losses agree up to float summation order
    assert np.allclose([r["loss"] for r in rows], base["loss"], rtol=1e-4), [r["loss"] for r in rows]
    print(json.dumps({"benchmark": "context_parallel", "seq_len": args.seq_len, "rows": rows}))


if __name__ == "__main__":
    main()
