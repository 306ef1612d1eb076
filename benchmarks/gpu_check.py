"""One-shot check of the GPU path on one lent GPU (an H100 or H200), within 8 minutes.

    python benchmarks/gpu_check.py                  # on the GPU machine, from the repository root
    python benchmarks/gpu_check.py --cpu-smoke      # the same path on a tiny model on CPU (tests)

1. JAX must see a GPU (else: one JSON line with "error" and exit 1); the device's jax, jaxlib,
   CUDA plugin, cuDNN and NCCL versions are recorded;
2. every case (EP transport x grouped implementation x optimizer: the fixed transport, whose
   receivers multiply their own buffers, once per optimizer; ragged_capacity, ragged and dropless
   with capacity, ragged_dot and tokamax; AdamW and MuonH, the published hero's optimizer, whose
   Newton-Schulz iterations run on the device too) runs the real train step of a d2048-like model
   (d2048 with 4 layers and 64 experts, 16 sequences of 4,096 tokens, bf16; the microbatch count
   the memory planner picks, as the trainer would) in its own process. Each compiles its step from
   shapes alone, several at a time (the machine's CPUs compile; no device memory is held), and
   holds the compiled step's own memory analysis against the plan exactly as the trainer does
   before its first step (marin.training.compiled_memory): a refused case reports its one line
   and never touches the device. A case that passes then takes the GPU alone (a lock), runs
   warm-up and timed steps: step time, tokens/s, MFU over the device's peak, and the device's peak
   memory (``memory_stats()["peak_bytes_in_use"]``) against the planner's figure;
3. the last line printed is one JSON object: {"stack": {...}, "cases": {"transport/impl/optimizer":
   {"fits", "refused", "tokens_per_s", "mfu", "step_s", "planned_bytes", "measured_peak_bytes", ...}},
   "gpu_mfu", "errors", ...}.

It imports only the JAX / optax / numpy parts of marin (no Ray, draccus or W&B), so it runs on a
bare image with jax's CUDA plugin. With --cpu-smoke, the measured peak is XLA's memory analysis of
the compiled step (a CPU device has no allocator statistics), gpu_mfu is the CPU's nominal MFU, and
the pre-step check is forced (on CPU ragged_dot and tokamax's XLA path are the dense fallback the
check refuses: the smoke shows the refusal path too).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from marin.kernels.names import GROUPED_IMPLS  # noqa: E402  (pure Python, no JAX)
from marin.models.config import EP_TRANSPORTS  # noqa: E402  (pure Python, no JAX)

BUDGET_S = 480.0  # the whole check, 8 minutes
# the hero's two transports first (fixed, then the capacity-bounded ragged one), then the worst-case ones
HERO_TRANSPORTS = ("fixed", "ragged_capacity")
TRANSPORT_ORDER = HERO_TRANSPORTS + tuple(t for t in EP_TRANSPORTS if t not in HERO_TRANSPORTS)
OPTIMIZERS = ("adamw", "muonh")
FIXED_IMPL = "-"  # the fixed transport does not call the grouped compute

# (model, overrides, pool, tokens_per_step, seq_len, dtype, timed steps)
GPU_CASE = ("d2048", {"n_layers": 4, "n_experts": 64}, "h200-1", 65_536, 4096, "bfloat16", 5)
CPU_CASE = ("tiny-ep", {"n_layers": 1}, "local-cpu-1", 1024, 32, None, 2)


def cases(transports, impls, optimizers) -> list[str]:
    """Case names ``transport/impl/optimizer`` in the order they run: by transport (the hero's first),
    the fixed transport once per optimizer."""
    out = []
    for t in transports:
        for opt in optimizers:
            out += [f"{t}/{FIXED_IMPL}/{opt}"] if t == "fixed" else [f"{t}/{i}/{opt}" for i in impls]
    return out


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU (checks the JSON contract)")
    p.add_argument("--transports", default=",".join(TRANSPORT_ORDER))
    p.add_argument("--impls", default=",".join(GROUPED_IMPLS), help="grouped implementations (the fixed transport "
                   "uses none)")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    p.add_argument("--jobs", type=int, default=None,
                   help="cases compiling at once (default: 4 on a GPU, 1 with --cpu-smoke); the device runs one")
    p.add_argument("--budget-s", type=float, default=BUDGET_S,
                   help=f"seconds for the whole check (default {BUDGET_S:.0f}); a case not begun with 20 s left "
                        "is skipped and said so")
    p.add_argument("--tokens-per-step", type=int, default=None,
                   help=f"tokens per step of the GPU case (default {GPU_CASE[3]:,}; fewer for a smaller device)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one case, in this process
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # what jax sees, in this process
    return p.parse_args(argv)


def _pool_for(device_kind: str, cpu_smoke: bool):
    """The one-device pool of this GPU (the planner's device memory follows the accelerator)."""
    import dataclasses  # noqa: I001  (in the child, with the rest of marin)

    from marin.pools import get_pool

    pool = get_pool(CPU_CASE[2] if cpu_smoke else GPU_CASE[2])
    if not cpu_smoke and "H100" in device_kind.upper():
        pool = dataclasses.replace(pool, name="h100-1", accelerator="H100")
    return pool


class _DeviceLock:
    """The device, one case at a time (compiles run in parallel; steps and peak memory do not)."""

    def __init__(self, path: str | None) -> None:
        self.path, self.f = path, None

    def __enter__(self):
        if self.path:
            self.f = open(self.path, "a")
            fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        if self.f:
            fcntl.flock(self.f, fcntl.LOCK_UN)
            self.f.close()


def run_case(case: str, cpu_smoke: bool) -> dict:
    """Compile one case's train step from shapes, check its memory against the plan, then (holding
    the device lock) time it and read its peak memory."""
    # JAX only in the children: the parent holds no device memory the cases need
    import jax
    import jax.numpy as jnp

    from marin.kernels.grouped import chosen_impl
    from marin.models.config import flops_per_token, get_preset
    from marin.parallel.mesh import batch_sharding, make_mesh, place_host_arrays
    from marin.training.compiled_memory import compiled_memory, judge
    from marin.training.config import ParallelismConfig, SyntheticDataConfig, TelemetryConfig, TrainConfig
    from marin.training.lowering import abstract_batch, abstract_state
    from marin.training.metrics import mfu, peak_flops_per_device
    from marin.training.optimizers import OPTIMIZERS as REGISTRY
    from marin.training.planning import USABLE_FRACTION, device_memory_bytes, memory_plan
    from marin.training.trainer import init_host_state, make_train_step, microbatches_for, model_config, synthetic_batch

    transport, impl, opt = case.split("/")
    model, overrides, _, tokens_per_step, seq_len, dtype, steps = CPU_CASE if cpu_smoke else GPU_CASE
    tokens_per_step = int(os.environ.get("MARIN_GPU_CHECK_TOKENS", tokens_per_step))
    device = jax.devices()[0]
    pool = _pool_for(device.device_kind, cpu_smoke)
    config = TrainConfig(output_path="", data=SyntheticDataConfig(), preset=model,
                         model=get_preset(model, **{**overrides, **({} if dtype is None else {"dtype": dtype})}),
                         pool=pool, tokens_per_step=tokens_per_step, seq_len_phases=((0.0, seq_len),),
                         telemetry=TelemetryConfig(wandb_project=None), optimizer=REGISTRY[opt](),
                         parallelism=ParallelismConfig(grouped_impl="auto" if impl == FIXED_IMPL else impl))
    cfg = model_config(config)
    n_micro = microbatches_for(config, cfg, pool, seq_len, transport)  # what the trainer would pick
    mesh = make_mesh(*pool.mesh)
    abstract, shardings = abstract_state(config, cfg, mesh)  # compiled from shapes: no device memory yet
    batch = tokens_per_step // seq_len
    step = make_train_step(config, cfg, mesh, transport, shardings, n_micro)
    t0 = time.perf_counter()
    compiled = step.lower(abstract, *abstract_batch(mesh, batch, seq_len)).compile()
    compile_s = time.perf_counter() - t0
    measured = compiled_memory(compiled)
    ran_impl = FIXED_IMPL if transport == "fixed" else chosen_impl(config.parallelism.grouped_impl)
    planned = memory_plan(cfg, pool, tokens_per_step, seq_len, n_micro, transport, optimizer=config.optimizer,
                          grouped_impl="auto" if transport == "fixed" else ran_impl)
    usable = int(device_memory_bytes(pool) * USABLE_FRACTION)
    verdict = judge(measured, planned, impl=ran_impl, transport=transport, microbatches=n_micro,
                    usable_bytes=None if cpu_smoke else usable)
    out = {"case": case, "transport": transport, "grouped_impl": ran_impl, "optimizer": opt, "microbatches": n_micro,
           "compile_s": round(compile_s, 2), "planned_bytes": planned["total"], "planned_parts": planned,
           "compiled_memory": measured, "planned_temp_bytes": verdict["planned_temp_bytes"],
           "temp_ratio": verdict["temp_ratio"], "fits": verdict["ok"], "refused": verdict.get("message"),
           "device": str(device), "backend": jax.default_backend()}
    if not verdict["ok"]:
        return out
    with _DeviceLock(os.environ.get("MARIN_GPU_CHECK_LOCK")):
        data = SyntheticDataConfig(vocab_size=cfg.vocab_size)
        sharding = batch_sharding(mesh)
        placed = []
        for i in range(steps + 2):
            b = synthetic_batch(data, i, batch, seq_len)
            placed.append((place_host_arrays(b["tokens"], sharding), place_host_arrays(b["segment_ids"], sharding)))
        state = place_host_arrays(init_host_state(config, cfg), shardings)
        lr = jnp.float32(1e-3)
        t0 = time.perf_counter()
        for tokens, segs in placed[:2]:  # warm-up
            state, m = compiled(state, tokens, segs, lr)
        jax.block_until_ready((state, m))
        warmup_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for tokens, segs in placed[2:]:
            state, m = compiled(state, tokens, segs, lr)
        jax.block_until_ready((state, m))
        elapsed = time.perf_counter() - t0
        stats = device.memory_stats() or {}
    tps = steps * tokens_per_step / elapsed
    peak = stats.get("peak_bytes_in_use")
    out.update({
        "tokens_per_s": round(tps, 1),
        "mfu": round(mfu(tps, flops_per_token(cfg, seq_len), pool.num_devices, peak_flops_per_device(pool.accelerator)),
                     4),
        "step_s": round(elapsed / steps, 4), "warmup_s": round(warmup_s, 2),
        "loss": round(float(m["loss"]), 4),
        "drop_frac_send": round(float(m["drop_frac_send"]), 6), "drop_frac_recv": round(float(m["drop_frac_recv"]), 6),
        # CPU: no allocator statistics; XLA's own analysis of the compiled step stands in
        "measured_peak_bytes": int(peak) if peak is not None else measured["total"],
        "measured_by": "device.memory_stats peak_bytes_in_use" if peak is not None else "compiled.memory_analysis",
    })
    return out


def _child_env(cpu_smoke: bool, lock: str | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if lock:
        env["MARIN_GPU_CHECK_LOCK"] = lock
    if cpu_smoke:
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    else:
        # several cases are alive at once (compiling); each takes device memory only while it holds the lock
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return env


def _nccl_version() -> str | None:
    """The NCCL the process loads (ncclGetVersion of libnccl.so.2), else its wheel's version."""
    import ctypes

    try:
        lib = ctypes.CDLL("libnccl.so.2")
        v = ctypes.c_int()
        if lib.ncclGetVersion(ctypes.byref(v)) == 0:
            code = v.value  # 22809 = 2.28.9 (NCCL >= 2.9: major * 10000 + minor * 100 + patch)
            return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    except (OSError, AttributeError):
        pass
    from importlib import metadata

    for dist in ("nvidia-nccl-cu13", "nvidia-nccl-cu12"):
        try:
            return metadata.version(dist) + f" ({dist})"
        except metadata.PackageNotFoundError:
            continue
    return None


def _probe() -> dict:
    """What jax sees (run in a child: the parent never holds device memory the steps need)."""
    import jax

    try:
        devices = jax.devices()
    except RuntimeError as e:
        return {"jax": jax.__version__, "ok": False, "what": f"jax sees no devices: {e}"}
    from importlib import metadata

    from marin.kernels.grouped import device_facts

    stack = {"jax": jax.__version__}
    for dist in ("jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "tokamax"):
        try:
            stack[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            stack[dist] = None
    facts = device_facts()
    stack["cudnn"] = ".".join(map(str, facts["cudnn_version"])) if facts.get("cudnn_version") else None
    stack["nccl"] = _nccl_version() if jax.default_backend() == "gpu" else None
    stack["compute_capability"] = facts.get("compute_capability")
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


def _summary_line(r: dict) -> str:
    if not r["fits"]:
        return f"{r['case']}: refused: {r['refused']}"
    return (f"{r['case']}: {r['tokens_per_s']:,.0f} tokens/s, MFU {r['mfu']:.1%}, step {r['step_s']:.3f} s, "
            f"drops {r['drop_frac_send'] + r['drop_frac_recv']:.4%}, planned {r['planned_bytes'] / 2**30:.2f} GiB vs "
            f"measured peak {r['measured_peak_bytes'] / 2**30:.2f} GiB; temporaries x{r['temp_ratio']:g} the plan")


def run_all(args, names: list[str], me: list[str], out: dict, started: float) -> None:
    """Run the cases, ``--jobs`` at a time, within the budget; results and errors into ``out``."""
    jobs = args.jobs or (1 if args.cpu_smoke else 4)
    lock = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"marin-gpu-check-{os.getpid()}.lock")
    env = _child_env(args.cpu_smoke, lock)
    pending, running = list(names), {}
    while pending or running:
        while pending and len(running) < jobs:
            case = pending.pop(0)
            left = args.budget_s - (time.monotonic() - started)
            if left < 20:
                out["errors"][case] = f"skipped: the {args.budget_s:.0f} s budget was spent"
                continue
            running[case] = (subprocess.Popen(me + ["--child", case], env=env, stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True), time.monotonic() + left)
        for case, (proc, deadline) in list(running.items()):
            if proc.poll() is None and time.monotonic() < deadline:
                continue
            if proc.poll() is None:
                proc.kill()
            stdout, stderr = proc.communicate()
            del running[case]
            if proc.returncode != 0:
                out["errors"][case] = (f"timed out at the {args.budget_s:.0f} s budget" if time.monotonic() >= deadline
                                       else _cause(stderr, proc.returncode))
                continue
            r = json.loads(stdout.strip().splitlines()[-1])
            print(_summary_line(r), file=sys.stderr, flush=True)
            out["cases"][case] = r
        time.sleep(0.2)
    if os.path.exists(lock):
        os.remove(lock)


def main(argv=None) -> int:
    args = _parse(argv)
    if args.probe:
        print(json.dumps(_probe()))
        return 0
    if args.child:
        print(json.dumps(run_case(args.child, args.cpu_smoke)))
        return 0
    started = time.monotonic()
    if args.tokens_per_step:  # the children read it from their environment
        os.environ["MARIN_GPU_CHECK_TOKENS"] = str(args.tokens_per_step)
    out: dict = {"mode": "cpu-smoke" if args.cpu_smoke else "gpu", "jax": None, "gpu": None, "stack": None,
                 "cases": {}, "errors": {}}
    me = [sys.executable, os.path.abspath(__file__)] + (["--cpu-smoke"] if args.cpu_smoke else [])
    probe = subprocess.run(me + ["--probe"], env=_child_env(args.cpu_smoke), capture_output=True, text=True,
                           timeout=120)
    if probe.returncode != 0:
        out["error"] = "cannot import jax: " + ((probe.stderr.strip().splitlines() or ["?"])[-1])[:500]
        print(json.dumps(out))
        return 1
    seen = json.loads(probe.stdout.strip().splitlines()[-1])
    out["jax"], out["stack"] = seen["jax"], seen.get("stack")
    print(", ".join(f"{k} {v}" for k, v in (seen.get("stack") or {}).items() if v), file=sys.stderr)
    if not args.cpu_smoke:
        out["gpu"] = seen["what"]
        if not seen["ok"]:
            out["error"] = seen["what"]
            print(json.dumps(out))
            return 1
    names = cases([t for t in args.transports.split(",") if t], [i for i in args.impls.split(",") if i],
                  [o for o in args.optimizers.split(",") if o])
    run_all(args, names, me, out, started)
    ran = {c: r for c, r in out["cases"].items() if r["fits"]}
    out["gpu_mfu"] = max((r["mfu"] for r in ran.values()), default=None)
    out["tokens_per_s"] = {c: r["tokens_per_s"] for c, r in ran.items()}
    out["refused"] = {c: r["refused"] for c, r in out["cases"].items() if not r["fits"]}
    out["planner_vs_measured_memory"] = {
        c: {"planned_bytes": r["planned_bytes"], "measured_bytes": r["measured_peak_bytes"],
            "ratio": round(r["planned_bytes"] / max(1, r["measured_peak_bytes"]), 3), "measured_by": r["measured_by"]}
        for c, r in ran.items()}
    out["wall_s"] = round(time.monotonic() - started, 1)
    # one line that says what did not run (or did not finish) and why, before the JSON
    print("not run: " + ("; ".join(f"{c}: {why}" for c, why in out["errors"].items()) or "nothing"), file=sys.stderr)
    print(json.dumps(out))
    return 0 if not out["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
