"""One-shot check of the GPU path on one lent GPU (an H200), within 8 minutes.

    python benchmarks/gpu_check.py                  # on the GPU machine, from the repository root
    python benchmarks/gpu_check.py --cpu-smoke      # the same path on a tiny model on CPU (tests)

1. JAX must see a GPU (else: one JSON line with "error" and exit 1);
2. for each EP transport (fixed, ragged_capacity and ragged: the real ``jax.lax.ragged_all_to_all``,
   dropless; the two the hero runs first, so a short budget measures them) the real
   train step (loss, grads, AdamW, router bias update) of a d2048-like model (d2048 with 4 layers
   and 64 experts, 16 sequences of 4,096 tokens, bf16; the microbatch count the memory planner picks,
   as the trainer would) runs in its own process: tokens/s and MFU
   over the device's peak, and the device's peak memory (``memory_stats()["peak_bytes_in_use"]``)
   against the memory planner's estimate of the same step;
3. the last line printed is one JSON object: {"gpu_mfu", "transports": {t: {"tokens_per_s", "mfu",
   ...}}, "planner_vs_measured_memory": {t: {"planned_bytes", "measured_bytes", "ratio"}}, ...}.

It imports only the JAX / optax / numpy parts of marin (no Ray, draccus or W&B), so it runs on a
bare image with jax's CUDA plugin. With --cpu-smoke, "measured" is XLA's memory analysis of the
compiled step (a CPU device has no allocator statistics) and gpu_mfu is the CPU's nominal MFU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from marin.models.config import EP_TRANSPORTS  # noqa: E402  (pure Python, no JAX)

BUDGET_S = 480.0  # the whole check, 8 minutes
# the hero's two transports first (fixed, then the capacity-bounded ragged one), then the worst-case ones
HERO_TRANSPORTS = ("fixed", "ragged_capacity")
TRANSPORT_ORDER = HERO_TRANSPORTS + tuple(t for t in EP_TRANSPORTS if t not in HERO_TRANSPORTS)

# (model, overrides, pool, tokens_per_step, seq_len, dtype, timed steps)
GPU_CASE = ("d2048", {"n_layers": 4, "n_experts": 64}, "h200-1", 65_536, 4096, "bfloat16", 5)
CPU_CASE = ("tiny-ep", {"n_layers": 2}, "local-cpu-1", 1024, 32, None, 2)


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU (checks the JSON contract)")
    p.add_argument("--transports", default=",".join(TRANSPORT_ORDER))
    p.add_argument("--budget-s", type=float, default=BUDGET_S,
                   help=f"seconds for the whole check (default {BUDGET_S:.0f}); a transport not begun with 20 s "
                        "left is skipped and said so")
    p.add_argument("--tokens-per-step", type=int, default=None,
                   help=f"tokens per step of the GPU case (default {GPU_CASE[3]:,}; fewer for a smaller device)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one transport, in this process
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # what jax sees, in this process
    return p.parse_args(argv)


def run_transport(transport: str, cpu_smoke: bool) -> dict:
    """Compile and time the train step of one transport in this process; its peak memory too."""
    import jax
    import jax.numpy as jnp

    from marin.models.config import flops_per_token, get_preset
    from marin.parallel.mesh import batch_sharding, make_mesh, place_host_arrays
    from marin.pools import get_pool
    from marin.training.config import SyntheticDataConfig, TelemetryConfig, TrainConfig
    from marin.training.metrics import mfu, peak_flops_per_device
    from marin.training.planning import memory_plan
    from marin.training.trainer import (
        init_host_state,
        make_train_step,
        microbatches_for,
        model_config,
        state_shardings,
        synthetic_batch,
    )

    model, overrides, pool_name, tokens_per_step, seq_len, dtype, steps = CPU_CASE if cpu_smoke else GPU_CASE
    tokens_per_step = int(os.environ.get("MARIN_GPU_CHECK_TOKENS", tokens_per_step))
    pool = get_pool(pool_name)
    config = TrainConfig(output_path="", data=SyntheticDataConfig(), preset=model,
                         model=get_preset(model, **{**overrides, **({} if dtype is None else {"dtype": dtype})}),
                         pool=pool_name, tokens_per_step=tokens_per_step, seq_len_phases=((0.0, seq_len),),
                         telemetry=TelemetryConfig(wandb_project=None))
    cfg = model_config(config)
    n_micro = microbatches_for(config, cfg, pool, seq_len, transport)  # what the trainer would pick
    data = SyntheticDataConfig(vocab_size=cfg.vocab_size)
    mesh = make_mesh(*pool.mesh)
    host = init_host_state(config, cfg)
    shardings = state_shardings(host, mesh)
    batch = tokens_per_step // seq_len
    sharding = batch_sharding(mesh)
    placed = []
    for i in range(steps + 2):
        b = synthetic_batch(data, i, batch, seq_len)
        placed.append((place_host_arrays(b["tokens"], sharding), place_host_arrays(b["segment_ids"], sharding)))
    state = place_host_arrays(host, shardings)
    del host
    step = make_train_step(config, cfg, mesh, transport, shardings, n_micro)
    lr = jnp.float32(1e-3)
    t0 = time.perf_counter()
    for tokens, segs in placed[:2]:  # compile + one warm step
        state, m = step(state, tokens, segs, lr)
    jax.block_until_ready((state, m))
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for tokens, segs in placed[2:]:
        state, m = step(state, tokens, segs, lr)
    jax.block_until_ready((state, m))
    elapsed = time.perf_counter() - t0
    tps = steps * tokens_per_step / elapsed
    fpt = flops_per_token(cfg, seq_len)
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        measured, measured_by = int(stats["peak_bytes_in_use"]), "device.memory_stats peak_bytes_in_use"
    else:  # CPU: no allocator statistics; XLA's own analysis of the compiled step
        ma = step.lower(state, *placed[0], lr).compile().memory_analysis()
        measured = int(ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
                       + ma.temp_size_in_bytes)
        measured_by = "compiled.memory_analysis"
    planned = memory_plan(cfg, pool, tokens_per_step, seq_len, n_micro, transport)
    return {
        "transport": transport,
        "microbatches": n_micro,
        "tokens_per_s": round(tps, 1),
        "mfu": round(mfu(tps, fpt, pool.num_devices, peak_flops_per_device(pool.accelerator)), 4),
        "step_s": round(elapsed / steps, 4),
        "compile_and_warmup_s": round(compile_s, 2),
        "loss": round(float(m["loss"]), 4),
        "drop_frac_send": round(float(m["drop_frac_send"]), 6),
        "drop_frac_recv": round(float(m["drop_frac_recv"]), 6),
        "planned_bytes": planned["total"],
        "planned_parts": planned,
        "measured_bytes": measured,
        "measured_by": measured_by,
        "device": str(device),
        "backend": jax.default_backend(),
    }


def _child_env(cpu_smoke: bool) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if cpu_smoke:
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    else:
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")  # what the memory planner plans on
    return env


def _probe() -> dict:
    """What jax sees (run in a child: the parent never holds device memory the steps need)."""
    import jax

    try:
        devices = jax.devices()
    except RuntimeError as e:
        return {"jax": jax.__version__, "ok": False, "what": f"jax sees no devices: {e}"}
    from importlib import metadata

    stack = {}
    for dist in ("jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "nvidia-nccl-cu13"):
        try:
            stack[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            stack[dist] = None
    if jax.default_backend() != "gpu":
        return {"jax": jax.__version__, "stack": stack, "ok": False,
                "what": f"jax sees no GPU (backend {jax.default_backend()!r}, devices {devices}); install jax[cuda13]"}
    return {"jax": jax.__version__, "stack": stack, "ok": True, "what": f"{len(devices)} x {devices[0].device_kind}"}


def _cause(stderr: str, returncode: int) -> str:
    """The line of a failed child's stderr that names its error: the last ``SomeError: ...`` line (JAX ends
    a traceback with a note about its filtered frames, which says nothing of the cause)."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Exhausted)\b.*:", line)]
    return ((errors or lines or [f"exit {returncode}"])[-1])[:500]


def main(argv=None) -> int:
    args = _parse(argv)
    if args.probe:
        print(json.dumps(_probe()))
        return 0
    if args.child:
        print(json.dumps(run_transport(args.child, args.cpu_smoke)))
        return 0
    started = time.monotonic()
    if args.tokens_per_step:  # the children read it from their environment
        os.environ["MARIN_GPU_CHECK_TOKENS"] = str(args.tokens_per_step)
    out: dict = {"mode": "cpu-smoke" if args.cpu_smoke else "gpu", "jax": None, "gpu": None, "transports": {},
                 "planner_vs_measured_memory": {}, "errors": {}}
    me = [sys.executable, os.path.abspath(__file__)] + (["--cpu-smoke"] if args.cpu_smoke else [])
    probe = subprocess.run(me + ["--probe"], env=_child_env(args.cpu_smoke), capture_output=True, text=True,
                           timeout=120)
    if probe.returncode != 0:
        out["error"] = "cannot import jax: " + ((probe.stderr.strip().splitlines() or ["?"])[-1])[:500]
        print(json.dumps(out))
        return 1
    seen = json.loads(probe.stdout.strip().splitlines()[-1])
    out["jax"], out["stack"] = seen["jax"], seen["stack"]
    print(f"jax {seen['jax']}, " + ", ".join(f"{k} {v}" for k, v in seen["stack"].items() if v), file=sys.stderr)
    if not args.cpu_smoke:
        out["gpu"] = seen["what"]
        if not seen["ok"]:
            out["error"] = seen["what"]
            print(json.dumps(out))
            return 1
    for transport in [t for t in args.transports.split(",") if t]:
        left = args.budget_s - (time.monotonic() - started)
        if left < 20:
            out["errors"][transport] = f"skipped: the {args.budget_s:.0f} s budget was spent"
            continue
        cmd = me + ["--child", transport]
        try:
            proc = subprocess.run(cmd, env=_child_env(args.cpu_smoke), capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            out["errors"][transport] = f"timed out after {left:.0f} s"
            continue
        if proc.returncode != 0:
            out["errors"][transport] = _cause(proc.stderr, proc.returncode)
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{transport}: {r['tokens_per_s']:,.0f} tokens/s, MFU {r['mfu']:.1%}, step {r['step_s']:.3f} s, drops "
              f"{r['drop_frac_send'] + r['drop_frac_recv']:.4%}, planned "
              f"{r['planned_bytes'] / 2**30:.2f} GiB vs measured {r['measured_bytes'] / 2**30:.2f} GiB",
              file=sys.stderr, flush=True)
        out["transports"][transport] = {k: r[k] for k in ("tokens_per_s", "mfu", "microbatches", "step_s",
                                                          "compile_and_warmup_s",
                                                          "loss", "drop_frac_send", "drop_frac_recv", "device",
                                                          "backend")}
        out["planner_vs_measured_memory"][transport] = {
            "planned_bytes": r["planned_bytes"], "measured_bytes": r["measured_bytes"],
            "ratio": round(r["planned_bytes"] / max(1, r["measured_bytes"]), 3), "measured_by": r["measured_by"],
            "planned_parts": r["planned_parts"]}
    mfus = [t["mfu"] for t in out["transports"].values()]
    out["gpu_mfu"] = max(mfus) if mfus else None
    out["tokens_per_s"] = {t: v["tokens_per_s"] for t, v in out["transports"].items()}
    out["wall_s"] = round(time.monotonic() - started, 1)
    # one line that says what did not run (or did not finish) and why, before the JSON
    print("skipped: " + ("; ".join(f"{t}: {why}" for t, why in out["errors"].items()) or "nothing"), file=sys.stderr)
    print(json.dumps(out))
    return 0 if not out["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
