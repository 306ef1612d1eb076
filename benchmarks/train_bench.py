"""Training throughput and MFU per EP transport, through the real train step (loss, grads, AdamW,
router bias update).

    python benchmarks/train_bench.py                       # tiny-ep on 8 fake CPU devices (EP 4 x DP 2)
    python benchmarks/train_bench.py --model d2048 --pool h200-1 \\
        --override n_layers=4 --override n_experts=64 --tokens-per-step 65536 --seq-len 4096   # one H200

The last line printed is one JSON object: {"<transport>": {"tokens_per_s": ..., "mfu": ...}, ...}.
MFU uses marin.models.config.flops_per_token (forward + backward, attention included) over the pool's
peak (marin.training.metrics.PEAK_FLOPS_PER_DEVICE; the CPU figure is nominal).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _bench_setup import add_model_flags, train_setup  # noqa: E402  (the benchmarks folder is on sys.path)


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_flags(p, seq_len=64)
    p.add_argument("--transports", default="local,fixed,dropless", help="comma-separated; 'ragged' needs a GPU")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after compilation")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    return p.parse_args()


def main() -> None:
    args = _parse()
    setup = train_setup(args)  # sets the pool's JAX environment before jax is imported
    import jax
    import jax.numpy as jnp

    from marin.models.config import flops_per_token
    from marin.parallel.mesh import place_host_arrays
    from marin.training.metrics import mfu, peak_flops_per_device
    from marin.training.trainer import make_train_step, synthetic_batch

    pool, config, cfg, data = setup["pool"], setup["config"], setup["cfg"], setup["data"]
    mesh, host_state, shardings = setup["mesh"], setup["host_state"], setup["shardings"]
    batch_size = args.tokens_per_step // args.seq_len
    batches = [synthetic_batch(data, i, batch_size, args.seq_len) for i in range(args.warmup + args.steps + 1)]
    sharding = setup["sharding"]
    fpt = flops_per_token(cfg, args.seq_len)
    peak = peak_flops_per_device(pool.accelerator)
    results = {}
    for transport in [t for t in args.transports.split(",") if t]:
        state = place_host_arrays(host_state, shardings)
        step = make_train_step(config, cfg, mesh, transport, shardings)
        lr = jnp.float32(1e-3)
        t0 = time.perf_counter()
        for i in range(args.warmup + 1):  # the first call compiles
            b = batches[i]
            state, m = step(state, *place_host_arrays((b["tokens"], b["segment_ids"]), sharding), lr)
        jax.block_until_ready(m)
        compile_s = time.perf_counter() - t0
        placed = [place_host_arrays((b["tokens"], b["segment_ids"]), sharding)
                  for b in batches[args.warmup + 1:]]
        t0 = time.perf_counter()
        for tokens, segs in placed:
            state, m = step(state, tokens, segs, lr)
        jax.block_until_ready((state, m))
        elapsed = time.perf_counter() - t0
        tps = args.steps * args.tokens_per_step / elapsed
        results[transport] = {
            "tokens_per_s": round(tps, 1),
            "mfu": mfu(tps, fpt, pool.num_devices, peak),
            "step_s": round(elapsed / args.steps, 4),
            "compile_and_warmup_s": round(compile_s, 2),
            "drop_frac_send": round(float(m["drop_frac_send"]), 4),
            "loss": round(float(m["loss"]), 4),
        }
        print(f"{transport}: {results[transport]}", file=sys.stderr, flush=True)
    print(json.dumps({"model": args.model, "pool": args.pool, "devices": pool.num_devices,
                      "backend": jax.default_backend(), "flops_per_token": fpt}), file=sys.stderr)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
