"""MoE block and model-step benchmark.

    python benchmarks/moe_bench.py [--d-model 1024] [--experts 32] [--tokens 2048] [--reps 5] [--no-small]
                                   [--no-large]

Measures, on this machine (8 fake CPU devices for EP=8), at the headline size (HEADLINE), again at the
small reference size d=256 (SMALL) and, on 1 device only, at the d2048 rung's MoE widths (LARGE):
  1. MoE block forward+backward vs a dense SwiGLU MLP with the same matmul FLOPs per token, on 1 device
     and with EP=8 (fixed-buffer all_to_all; the dense MLP runs data-parallel on the same 8 devices);
  2. MoE block (sorted grouped matmul) vs a naive one-hot einsum dispatch (GShard-style [T, E, C] masks);
  3. MFU of a small full-model training step (fwd+bwd) against this CPU's measured matmul rate;
  4. the rate of one expert GEMM with marin's CPU grouped kernel, XLA's batched dot and XLA's 2-D dot;
  5. on a GPU backend: MFU of a d2048-like model step against the chip's bf16 peak.
Prints a table; the last line is one JSON object.

The script restarts itself with marin.runtime's host allocator settings (MARIN_HOST_MALLOC=0 keeps
glibc's defaults); both the MoE block and the dense baseline run under the same settings.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # restart with the host allocator settings before JAX starts (marin.runtime)
    from marin.runtime import reexec_with_host_malloc

    reexec_with_host_malloc()

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from marin.kernels.cpu import available as cpu_kernel_available  # noqa: E402
from marin.kernels.grouped import swiglu_experts  # noqa: E402
from marin.models import transformer as tf  # noqa: E402
from marin.models.config import MoEConfig, flops_per_token  # noqa: E402
from marin.parallel.capacity import recv_capacity  # noqa: E402
from marin.parallel.mesh import TOKEN_AXES, make_mesh, param_shardings  # noqa: E402
from marin.runtime import host_malloc_active  # noqa: E402


def timeit(fn, *args, reps=5, warmup=2):
    """Best of `reps` wall times (the minimum is the least disturbed by other jobs on a shared machine)."""
    for _ in range(warmup):  # compile + warm up
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return min(times)


def timeit_pair(a, a_args, b, b_args, reps=5):
    """Best-of wall and process-CPU times of two functions measured alternately, so load changes from
    other jobs hit both alike. Returns ((wall_a, wall_b), (cpu_a, cpu_b))."""
    wall, cpu = ([], []), ([], [])
    for f, args in ((a, a_args), (b, b_args)):
        for _ in range(2):
            jax.block_until_ready(f(*args))
    for _ in range(reps):
        for i, (f, args) in enumerate(((a, a_args), (b, b_args))):
            t, c = time.perf_counter(), time.process_time()
            jax.block_until_ready(f(*args))
            wall[i].append(time.perf_counter() - t)
            cpu[i].append(time.process_time() - c)
    return (min(wall[0]), min(wall[1])), (min(cpu[0]), min(cpu[1]))


# d_model, n_experts, tokens per call. The headline uses hero ratios at d=1024 (latent, expert and shared
# widths 512): at d=256 (widths 128) the CPU's small-matmul inefficiency dominates; that size is still
# measured and reported (JSON keys d256_*).
HEADLINE = (1024, 32, 2048)
SMALL = (256, 32, 4096)
LARGE = (2048, 32, 4096)  # the d2048 rung's MoE widths (latent = expert = shared width 1024); 1 device only


def block_cfg(d_model: int = 256, n_experts: int = 32) -> MoEConfig:
    # hero ratios: latent = expert width = shared width = d/2, top-8, 2 shared experts
    h = d_model // 2
    return MoEConfig(vocab_size=512, d_model=d_model, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=128,
                     latent_dim=h, n_experts=n_experts, top_k=8, expert_width=h, n_shared_experts=2,
                     shared_width=h, capacity_factor=1.15, dtype="float32")


def block_matmul_params(cfg: MoEConfig) -> int:
    """Matmul params a token touches in the MoE block (= its FLOPs / 2 per token, forward)."""
    d = cfg.d_model
    return (3 * d * cfg.shared_width * cfg.n_shared_experts + 2 * d * cfg.latent_dim
            + cfg.latent_dim * cfg.n_experts + cfg.top_k * 3 * cfg.latent_dim * cfg.expert_width)


def moe_block_step(cfg, mesh, transport):
    def loss(p, x, probe):
        y, _ = tf.moe_block(x, p, jnp.zeros((cfg.n_experts,)), cfg, mesh, transport)
        return jnp.sum(y * probe)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def dense_step():
    def loss(p, x, probe):
        return jnp.sum(tf.swiglu(x, p["gate"], p["up"], p["down"]) * probe)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def norouting_step(cfg):
    """The MoE block's matmuls without routing: every expert gets exactly T*k/E rows (no padding) and
    there is no dispatch or combine (each token's latent is simply repeated k times); plain autodiff
    through `swiglu_experts`. Not a model; it separates the cost of the matmuls from the cost of
    routing. (Before the grouped kernel it was the floor of any XLA batched-dot layout: 1.36x dense.)"""

    def loss(p, x, probe):
        b, l, d = x.shape
        t, e, k = b * l, cfg.n_experts, cfg.top_k
        xf = x.reshape(t, d)
        shared = tf.swiglu(xf, p["shared_gate"], p["shared_up"], p["shared_down"])
        z = xf @ p["latent_down"]
        zb = jnp.broadcast_to(z[None], (k,) + z.shape).reshape(e, t * k // e, -1)
        yb = swiglu_experts(zb, p["expert_gate"], p["expert_up"], p["expert_down"])
        y = jnp.sum(yb.reshape(k, t, -1), axis=0)
        return jnp.sum((shared + y @ p["latent_up"]).reshape(x.shape) * probe)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def onehot_step(cfg):
    """Naive GShard-style dispatch: one-hot [T, E, C] masks and einsums (the baseline)."""
    from marin.models import router as rt

    def moe(p, x):
        b, l, d = x.shape
        xf = x.reshape(b * l, d)
        shared = tf.swiglu(xf, p["shared_gate"], p["shared_up"], p["shared_down"])
        z = xf @ p["latent_down"]
        ids, w, _ = rt.route(z, p["router"], jnp.zeros((cfg.n_experts,)), cfg.top_k)
        t, e = z.shape[0], cfg.n_experts
        cap = recv_capacity(t, cfg.top_k, e, 1, cfg.capacity_factor)  # one device: every expert is local
        chosen = jnp.sum(jax.nn.one_hot(ids, e), axis=1)  # [T, E] 0/1
        gate = jnp.sum(jax.nn.one_hot(ids, e) * w[..., None], axis=1)  # [T, E] combine weights
        pos = (jnp.cumsum(chosen, axis=0) - 1).astype(jnp.int32)  # slot of token t in expert e's buffer
        keep = chosen * (pos < cap)
        dispatch = keep[..., None] * jax.nn.one_hot(pos, cap)  # [T, E, C]
        combine = dispatch * gate[..., None]
        xe = jnp.einsum("tec,td->ecd", dispatch, z)
        g = jnp.einsum("ecd,edf->ecf", xe, p["expert_gate"])
        u = jnp.einsum("ecd,edf->ecf", xe, p["expert_up"])
        ye = jnp.einsum("ecf,efd->ecd", jax.nn.silu(g) * u, p["expert_down"])
        y = jnp.einsum("tec,ecd->td", combine, ye)
        return (shared + y @ p["latent_up"]).reshape(b, l, d)

    def loss(p, x, probe):
        return jnp.sum(moe(p, x) * probe)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def matmul_rate(n=1024, reps=5):
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    f = jax.jit(lambda a, b: a @ b)
    return 2 * n**3 / timeit(f, a, b, reps=reps)


def expert_gemm_rates(cfg: MoEConfig, n_tok: int, reps: int = 5) -> dict:
    """GFLOP/s of one expert GEMM of the MoE block (each expert's T*k/E rows x latent x expert width)
    three ways: marin's grouped kernel, XLA's batched dot (the einsum it replaces) and, for scale,
    XLA's plain 2-D dot with the same FLOPs (the dense baseline's kind of matmul)."""
    from marin.kernels import cpu

    e, c = cfg.n_experts, n_tok * cfg.top_k // cfg.n_experts
    a = jax.random.normal(jax.random.key(0), (e, c, cfg.latent_dim))
    b = jax.random.normal(jax.random.key(1), (e, cfg.latent_dim, cfg.expert_width))
    flops = 2 * e * c * cfg.latent_dim * cfg.expert_width
    calls = {
        "kernel": (jax.jit(cpu.grouped_matmul), (a, b)),
        "xla_batched": (jax.jit(lambda a, b: jnp.einsum("gmk,gkn->gmn", a, b)), (a, b)),
        "xla_dense2d": (jax.jit(jnp.matmul), (a.reshape(e * c, -1), b[0])),
    }
    return {k: flops / timeit(f, *args, reps=reps) / 1e9 for k, (f, args) in calls.items()}


def model_step(cfg, batch, seq):
    params = tf.init_params(cfg, jax.random.key(0))
    bias = tf.init_router_bias(cfg)
    tokens = jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, cfg.vocab_size, dtype=jnp.int32)
    f = jax.jit(jax.grad(lambda p, b, t: tf.loss_and_stats(p, b, t, cfg)[0]))
    secs = timeit(f, params, bias, tokens, reps=3)
    return flops_per_token(cfg, seq) * batch * seq / secs, secs


def block_times(cfg: MoEConfig, n_tok: int, reps: int, extras: bool = True, ep8: bool = True) -> dict:
    """MoE block vs the same-FLOPs dense SwiGLU, fwd+bwd, on 1 device and with EP=8 (best-of wall and
    process-CPU times, measured alternately). extras: also the one-hot baseline, the no-routing matmuls and
    EP=8 dropless; ep8=False: 1 device only."""
    full = tf.init_params(cfg, jax.random.key(0))
    p = jax.tree.map(lambda a: a[0], full["blocks"])
    x = jax.random.normal(jax.random.key(2), (n_tok // 128, 128, cfg.d_model))
    probe = jax.random.normal(jax.random.key(3), x.shape)
    width = block_matmul_params(cfg) // (3 * cfg.d_model)  # dense SwiGLU with the same FLOPs
    kd = jax.random.split(jax.random.key(4), 3)
    dense = {"gate": jax.random.normal(kd[0], (cfg.d_model, width)) / math.sqrt(cfg.d_model),
             "up": jax.random.normal(kd[1], (cfg.d_model, width)) / math.sqrt(cfg.d_model),
             "down": jax.random.normal(kd[2], (width, cfg.d_model)) / math.sqrt(width)}
    xd = x.reshape(-1, cfg.d_model)
    pd = probe.reshape(-1, cfg.d_model)
    r = {"width": width}
    (r["dense1"], r["moe1"]), (r["c_dense1"], r["c_moe1"]) = timeit_pair(
        dense_step(), (dense, xd, pd), moe_block_step(cfg, None, "local"), (p, x, probe), reps=reps)
    if extras:
        r["onehot"] = timeit(onehot_step(cfg), p, x, probe, reps=1, warmup=1)  # slow: O(T^2) masks
        (r["dense1_f"], r["norouting1"]), _ = timeit_pair(dense_step(), (dense, xd, pd), norouting_step(cfg),
                                                          (p, x, probe), reps=reps)
    if not ep8:
        return r

    mesh = make_mesh(1, 8)
    tok = NamedSharding(mesh, P(TOKEN_AXES))
    rep = NamedSharding(mesh, P())
    x8, probe8 = jax.device_put(x, tok), jax.device_put(probe, tok)
    p8 = jax.device_put(p, jax.tree.map(lambda s: NamedSharding(mesh, P(*s.spec[1:])),
                                        param_shardings(full["blocks"], mesh)))
    (r["dense8"], r["moe8"]), (r["c_dense8"], r["c_moe8"]) = timeit_pair(
        dense_step(), (jax.device_put(dense, rep), jax.device_put(xd, tok), jax.device_put(pd, tok)),
        moe_block_step(cfg, mesh, "fixed"), (p8, x8, probe8), reps=reps)
    if extras:
        r["moe8_dl"] = timeit(moe_block_step(cfg, mesh, "dropless"), p8, x8, probe8, reps=min(reps, 3), warmup=1)
    return r


RATIOS = {
    "moe_vs_dense_1dev": ("moe1", "dense1"),
    "moe_vs_dense_ep8": ("moe8", "dense8"),
    "moe_vs_onehot_1dev": ("moe1", "onehot"),
    "norouting_vs_dense_1dev": ("norouting1", "dense1_f"),
    "moe_vs_dense_1dev_cpu_time": ("c_moe1", "c_dense1"),
    "moe_vs_dense_ep8_cpu_time": ("c_moe8", "c_dense8"),
}
"""The JSON line's ratios: name -> (measured, baseline) in :func:`block_times`' results."""


def ratios(res: dict, prefix: str) -> dict:
    """The ratios of :data:`RATIOS` that ``res`` measured (a size timed without the extras or on one
    device has fewer), named ``prefix + name``."""
    return {prefix + name: round(res[a] / res[b], 3) for name, (a, b) in RATIOS.items() if a in res and b in res}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=HEADLINE[0], help="MoE block width (latent etc. = d/2)")
    ap.add_argument("--experts", type=int, default=HEADLINE[1])
    ap.add_argument("--tokens", type=int, default=HEADLINE[2], help="tokens per MoE block call")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-small", action="store_true", help="skip the d=256 reference size")
    ap.add_argument("--no-large", action="store_true", help="skip the d=2048 size (about a minute)")
    args = ap.parse_args(argv)

    cfg = block_cfg(args.d_model, args.experts)
    n_tok = args.tokens
    r = block_times(cfg, n_tok, args.reps)
    small_cfg = block_cfg(*SMALL[:2])
    small = None if args.no_small or (args.d_model, args.experts, n_tok) == SMALL else \
        block_times(small_cfg, SMALL[2], args.reps, extras=False)
    large_cfg = block_cfg(*LARGE[:2])
    large = None if args.no_large or (args.d_model, args.experts, n_tok) == LARGE else \
        block_times(large_cfg, LARGE[2], min(args.reps, 3), extras=False, ep8=False)

    peak = matmul_rate()
    gemm = expert_gemm_rates(cfg, n_tok, args.reps)
    mcfg = MoEConfig(vocab_size=2048, d_model=256, n_layers=4, n_heads=4, n_kv_heads=1, head_dim=64,
                     max_seq_len=256, sliding_window=64, latent_dim=128, n_experts=16, top_k=4, expert_width=128,
                     n_shared_experts=2, shared_width=128, dtype="float32")
    achieved, step_s = model_step(mcfg, batch=8, seq=256)
    cpu_mfu = achieved / peak

    result = ratios(r, "")
    if small is not None:
        result.update(ratios(small, "d256_"))
    if large is not None:
        result.update(ratios(large, "d2048_"))
    result.update({
        "cpu_grouped_gemm_kernel": cpu_kernel_available(),
        **{f"expert_gemm_gflops_{k}": round(v, 1) for k, v in gemm.items()},
        "cpu_mfu": round(cpu_mfu, 4),
        "cpu_matmul_gflops": round(peak / 1e9, 1),
        "cpu_step_gflops": round(achieved / 1e9, 1),
        "d_model": cfg.d_model,
        "n_experts": cfg.n_experts,
        "tokens_per_block_call": n_tok,
        "backend": jax.default_backend(),
        "host_malloc_tuned": host_malloc_active(),
    })
    if jax.default_backend() == "gpu":
        result.update(gpu_mfu())

    def table(c, t, res, name):
        print(f"MoE block ({name}): d={c.d_model} latent={c.latent_dim} E={c.n_experts} top-{c.top_k} "
              f"expert width {c.expert_width} shared={c.n_shared_experts}x{c.shared_width}; dense width "
              f"{res['width']}; {t} tokens; fwd+bwd")
        print(f"  {'(best-of wall time)':<48} {'ms':>9}  {'x dense':>8}")
        rows = [("dense SwiGLU (same FLOPs), 1 dev", res["dense1"], None),
                ("MoE block local, 1 dev", res["moe1"], res["dense1"]),
                ("MoE one-hot einsum dispatch, 1 dev", res.get("onehot"), res["dense1"]),
                ("same matmuls, no routing (autodiff), 1 dev", res.get("norouting1"), res.get("dense1_f")),
                ("dense SwiGLU data-parallel, 8 fake dev", res.get("dense8"), None),
                ("MoE block EP=8 fixed (cf 1.15)", res.get("moe8"), res.get("dense8")),
                ("MoE block EP=8 dropless (a2a worst case)", res.get("moe8_dl"), res.get("dense8"))]
        for label, secs, base in rows:
            if secs is not None:
                print(f"  {label:<48} {secs * 1e3:9.2f}  {'' if base is None else f'{secs / base:7.2f}x'}")
        ep8 = f", EP=8 {res['c_moe8'] / res['c_dense8']:.2f}" if "c_moe8" in res else ""
        print(f"  MoE/dense ratio, process CPU time: 1 dev {res['c_moe1'] / res['c_dense1']:.2f}{ep8}")

    table(cfg, n_tok, r, "headline")
    if small is not None:
        table(small_cfg, SMALL[2], small, "reference small size")
    if large is not None:
        table(large_cfg, LARGE[2], large, "d2048 rung widths")
    print(f"  host allocator settings (marin.runtime): {'on' if host_malloc_active() else 'off'}; "
          f"CPU grouped GEMM kernel (marin.kernels.cpu): {'on' if cpu_kernel_available() else 'off'}")
    print(f"  expert GEMM [{cfg.n_experts} x {n_tok * cfg.top_k // cfg.n_experts} x {cfg.latent_dim}] @ "
          f"[{cfg.latent_dim} x {cfg.expert_width}], GFLOP/s: grouped kernel {gemm['kernel']:.0f}, XLA batched "
          f"dot {gemm['xla_batched']:.0f}, XLA 2-D dot of the same FLOPs {gemm['xla_dense2d']:.0f}")
    print(f"  {'CPU matmul rate (1024^3 f32)':<48} {peak / 1e9:9.1f} GFLOP/s")
    print(f"  {'model step (4L d256 E16 top4, 8x256 tok)':<48} {step_s * 1e3:9.2f} ms  "
          f"{achieved / 1e9:.1f} GFLOP/s  MFU {cpu_mfu:.1%}")
    print(json.dumps(result))
    return 0


def gpu_mfu() -> dict:
    """A d2048-like step on one GPU (bf16), MFU against the H200 dense bf16 peak (989 TFLOP/s)."""
    cfg = MoEConfig(vocab_size=128_256, d_model=2048, n_layers=4, n_heads=16, n_kv_heads=4, head_dim=128,
                    max_seq_len=4096, sliding_window=1024, latent_dim=1024, n_experts=64, top_k=8,
                    expert_width=1024, n_shared_experts=2, shared_width=1024, dtype="bfloat16",
                    remat_policy="dots")
    achieved, step_s = model_step(cfg, batch=8, seq=4096)
    peak = float(os.environ.get("MARIN_GPU_PEAK_FLOPS", 989e12))
    return {"gpu_mfu": round(achieved / peak, 4), "gpu_step_s": round(step_s, 4)}


if __name__ == "__main__":
    raise SystemExit(main())
