"""Step-time overhead of MuonH over AdamW: the real train step (loss, grads, the optimizer's update,
router-bias update) with each optimizer, on one device and on the 8-device EP mesh, in one run.

    python benchmarks/optimizer_bench.py                          # tiny-ep, 1 CPU device and the 2 x 4 CPU mesh
    python benchmarks/optimizer_bench.py --model d2048 --override n_layers=2 --override n_experts=16 \\
        --meshes 1x1 --tokens-per-step 16384 --seq-len 1024        # one GPU

The last line printed is one JSON object: per mesh, each optimizer's median step time over
``--repeats`` timed blocks of ``--steps`` steps, the two optimizers' blocks interleaved (a shared
machine slows both alike), and the ratio MuonH / AdamW (1.0: no overhead), measured in this run on
the same model, batch and devices.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from _bench_setup import add_preset_flags, parse_overrides  # the benchmarks folder is on sys.path


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_preset_flags(p)
    p.add_argument("--meshes", default="1x1,2x4", help="comma-separated data x expert meshes")
    p.add_argument("--tokens-per-step", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after compilation")
    p.add_argument("--steps", type=int, default=5, help="timed steps per repeat")
    p.add_argument("--repeats", type=int, default=5, help="timed blocks per optimizer, interleaved (the median counts)")
    return p.parse_args()


def main() -> None:
    args = _parse()
    meshes = [tuple(int(x) for x in m.split("x")) for m in args.meshes.split(",") if m]
    devices = max(d * e for d, e in meshes)
    if "JAX_PLATFORMS" not in os.environ or os.environ["JAX_PLATFORMS"] == "cpu":  # fake CPU devices, before jax
        os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={max(devices, 1)}")
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from marin.models.config import get_preset
    from marin.parallel.mesh import batch_sharding, make_mesh, place_host_arrays
    from marin.training.config import SyntheticDataConfig, TelemetryConfig, TrainConfig
    from marin.training.optimizers import AdamWConfig, MuonHConfig
    from marin.training.trainer import init_host_state, make_train_step, model_config, state_shardings, synthetic_batch

    model = get_preset(args.model, **parse_overrides(args.override))
    data = SyntheticDataConfig(vocab_size=model.vocab_size)
    batch_size = args.tokens_per_step // args.seq_len
    batches = [synthetic_batch(data, i, batch_size, args.seq_len) for i in range(args.warmup + args.steps + 1)]
    results: dict = {}
    for shape in meshes:
        mesh = make_mesh(*shape)
        transport = "local" if shape[1] == 1 else "fixed"
        sharding = batch_sharding(mesh)
        name = f"{shape[0]}x{shape[1]}"
        results[name] = {}
        steps, states = {}, {}
        for opt in (AdamWConfig(), MuonHConfig()):
            config = TrainConfig(output_path="", data=data, model=model, tokens_per_step=args.tokens_per_step,
                                 seq_len_phases=((0.0, args.seq_len),), optimizer=opt,
                                 telemetry=TelemetryConfig(wandb_project=None))
            cfg = model_config(config)
            host = init_host_state(config, cfg)
            shardings = state_shardings(host, mesh)
            steps[opt.kind] = (make_train_step(config, cfg, mesh, transport, shardings),
                               jnp.float32(opt.peak_lr))  # each at its own default peak (MuonH's LR is an angle)
            states[opt.kind] = place_host_arrays(host, shardings)
            for b in batches[:args.warmup + 1]:  # the first call compiles
                states[opt.kind], m = steps[opt.kind][0](
                    states[opt.kind], *place_host_arrays((b["tokens"], b["segment_ids"]), sharding), steps[opt.kind][1])
            jax.block_until_ready(m)
        placed = [place_host_arrays((b["tokens"], b["segment_ids"]), sharding) for b in batches[args.warmup + 1:]]
        times: dict[str, list[float]] = {k: [] for k in steps}
        losses: dict[str, float] = {}
        for _ in range(args.repeats):  # interleaved, so a busy machine slows both alike
            for kind, (step, lr) in steps.items():
                t0 = time.perf_counter()
                for tokens, segs in placed:
                    states[kind], m = step(states[kind], tokens, segs, lr)
                jax.block_until_ready((states[kind], m))
                times[kind].append((time.perf_counter() - t0) / args.steps)
                losses[kind] = float(m["loss"])
        for kind in steps:
            results[name][kind] = {"step_s": round(statistics.median(times[kind]), 5), "loss": round(losses[kind], 4)}
            print(f"{name} {kind}: {results[name][kind]}", file=sys.stderr, flush=True)
        results[name]["muonh_over_adamw"] = round(results[name]["muonh"]["step_s"] / results[name]["adamw"]["step_s"],
                                                  3)
    print(json.dumps({"model": args.model, "backend": jax.default_backend(), "tokens_per_step": args.tokens_per_step,
                      "seq_len": args.seq_len}), file=sys.stderr)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
