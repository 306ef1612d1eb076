"""Dense vs blocked attention: compiled memory and speed of forward + backward.

    python benchmarks/attention_bench.py [--lengths 1024,2048,4096,8192] [--block 512] [--speed-len 2048]

For each sequence length, XLA's memory analysis (temporary bytes) of the jitted gradient of one
attention call (1 sequence, 12 query heads over 4 KV heads, head size 64, float32, causal) with the
dense [L, L] scores and with ``marin.models.blocked_attention`` (compiled only, nothing allocated).
Then the time of that gradient at ``--speed-len`` for both, causal (global layer) and with a sliding
window of ``--window`` (local layer), and the blocked / dense time ratio (> 1: blocked is slower).
Prints a table; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from marin.models.blocked_attention import blocked_attention
from marin.models.transformer import GLOBAL_WINDOW, dense_attention

KV, G, HD = 4, 3, 64


def grad_fn(impl: str, block: int):
    def loss(q, k, v, window):
        o = (dense_attention(q, k, v, window) if impl == "dense"
             else blocked_attention(q, k, v, window, block=block))
        return jnp.sum(o * o)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def shapes(length: int):
    return (jax.ShapeDtypeStruct((1, length, KV, G, HD), jnp.float32),
            jax.ShapeDtypeStruct((1, length, KV, HD), jnp.float32),
            jax.ShapeDtypeStruct((1, length, KV, HD), jnp.float32),
            jax.ShapeDtypeStruct((), jnp.int32))


def temp_bytes(impl: str, length: int, block: int) -> int:
    return grad_fn(impl, block).lower(*shapes(length)).compile().memory_analysis().temp_size_in_bytes


def seconds(impl: str, length: int, block: int, window: int, reps: int) -> float:
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    args = [jax.random.normal(kk, s.shape, s.dtype) for kk, s in zip(keys, shapes(length)[:3])]
    fn = grad_fn(impl, block)
    w = jnp.int32(window)
    jax.block_until_ready(fn(*args, w))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args, w))
        best = min(best, time.perf_counter() - t)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,2048,4096,8192")
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--speed-len", type=int, default=2048)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    result: dict = {"block": args.block, "backend": jax.default_backend(), "temp_mib": {}}
    print(f"gradient of one attention call, {KV * G} heads ({KV} KV), head size {HD}, f32, block {args.block}")
    print(f"  {'L':>7} {'dense temp MiB':>15} {'blocked temp MiB':>17} {'ratio':>7}")
    for length in (int(x) for x in args.lengths.split(",")):
        d, b = temp_bytes("dense", length, args.block), temp_bytes("blocked", length, args.block)
        result["temp_mib"][length] = {"dense": round(d / 2**20, 2), "blocked": round(b / 2**20, 2)}
        print(f"  {length:>7} {d / 2**20:>15.1f} {b / 2**20:>17.1f} {d / b:>7.1f}")
    for label, window in (("causal", GLOBAL_WINDOW), (f"window {args.window}", args.window)):
        td = seconds("dense", args.speed_len, args.block, window, args.reps)
        tb = seconds("blocked", args.speed_len, args.block, window, args.reps)
        key = "causal" if window == GLOBAL_WINDOW else "window"
        result[f"time_ratio_{key}"] = round(tb / td, 3)
        result[f"dense_s_{key}"], result[f"blocked_s_{key}"] = round(td, 4), round(tb, 4)
        print(f"  L={args.speed_len} {label}: dense {td * 1e3:.1f} ms, blocked {tb * 1e3:.1f} ms, "
              f"blocked/dense {tb / td:.2f}x")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
