"""KV-cache decoding: tokens/s, and how the per-token time grows with the context (512 vs 64).

    python benchmarks/decode_bench.py                         # the tiny preset on one CPU device
    python benchmarks/decode_bench.py --model d768 --override n_layers=4 --batch 8   # on a GPU

For each context C in --contexts: B prompts of C tokens are prefilled, then --new-tokens tokens are
decoded one at a time through the jitted step ``marin.models.decode`` generation runs (greedy, the
next token read back each step, as ``generate_tokens`` does), timed after compilation. The baseline,
measured in the same run, is what decoding without a cache costs: one full forward over the C + 1
positions per new token (``marin.models.transformer.forward``, jitted). Prints per-token times,
decode tokens/s, the 512/64 ratio with the cache against the ratio of recomputation, and, last, one
JSON object. Needs only JAX and marin's model code (no Ray), so it runs as is on the device machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from _bench_setup import add_preset_flags, parse_overrides  # the benchmarks folder is on sys.path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_preset_flags(p, model="tiny")
    p.add_argument("--batch", type=int, default=4, help="prompts decoded together")
    p.add_argument("--contexts", default="64,512", help="comma-separated prompt lengths (first = the baseline)")
    p.add_argument("--new-tokens", type=int, default=32, help="timed decode steps per context")
    p.add_argument("--recompute-steps", type=int, default=8, help="timed full forwards per context")
    return p.parse_args()


def main() -> None:
    args = _parse()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from marin.models.config import get_preset
    from marin.models.decode import decode_step, init_cache
    from marin.models.transformer import forward, init_params, init_router_bias

    contexts = [int(c) for c in args.contexts.split(",")]
    longest = max(contexts) + args.new_tokens + 1
    overrides = {"max_seq_len": longest, **parse_overrides(args.override)}
    cfg = get_preset(args.model, **overrides).replace(transport="local", remat_policy="none")
    params = init_params(cfg, jax.random.PRNGKey(0))
    bias = init_router_bias(cfg)
    step = jax.jit(lambda p, b, c, t, pos: decode_step(p, b, c, t, pos, cfg), donate_argnums=(2,))
    full = jax.jit(lambda p, b, x: jnp.argmax(forward(p, b, x, cfg)[0][:, -1], axis=-1))
    rng = np.random.default_rng(0)
    results = {}
    for ctx in contexts:
        prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (args.batch, ctx)), jnp.int32)
        pos = jnp.broadcast_to(jnp.arange(ctx, dtype=jnp.int32), (args.batch, ctx))
        cache = init_cache(cfg, args.batch, ctx + args.new_tokens + 1)
        logits, cache = step(params, bias, cache, prompt, pos)
        tok = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
        # one untimed decode step compiles the T = 1 program
        logits, cache = step(params, bias, cache, tok[:, None], jnp.full((args.batch, 1), ctx, jnp.int32))
        tok = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
        t0 = time.perf_counter()
        for i in range(args.new_tokens):
            p = jnp.full((args.batch, 1), ctx + 1 + i, jnp.int32)
            logits, cache = step(params, bias, cache, tok[:, None], p)
            tok = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
            np.asarray(tok)  # read back, as generation does to check for stop tokens
        cached_s = (time.perf_counter() - t0) / args.new_tokens
        seq = jnp.concatenate([prompt, tok[:, None]], axis=1)
        np.asarray(full(params, bias, seq))  # compile
        t0 = time.perf_counter()
        for _ in range(args.recompute_steps):
            np.asarray(full(params, bias, seq))
        recompute_s = (time.perf_counter() - t0) / args.recompute_steps
        results[ctx] = {"cached_s_per_token": cached_s, "recompute_s_per_token": recompute_s,
                        "decode_tokens_per_s": args.batch / cached_s}
        print(f"context {ctx:>5}: cached {1e3 * cached_s:8.3f} ms/step ({args.batch / cached_s:9.1f} tokens/s), "
              f"recompute {1e3 * recompute_s:8.3f} ms/step")
    lo, hi = contexts[0], contexts[-1]
    cache_ratio = results[hi]["cached_s_per_token"] / results[lo]["cached_s_per_token"]
    recompute_ratio = results[hi]["recompute_s_per_token"] / results[lo]["recompute_s_per_token"]
    print(f"per-token time at context {hi} vs {lo}: x{cache_ratio:.2f} with the cache, x{recompute_ratio:.2f} "
          f"recomputing (positions x{hi / lo:.0f}); cache speed-up at {hi}: "
          f"x{results[hi]['recompute_s_per_token'] / results[hi]['cached_s_per_token']:.1f}")
    print(json.dumps({"bench": "decode", "model": args.model, "overrides": overrides, "batch": args.batch,
                      "device": jax.devices()[0].platform, "contexts": {str(k): v for k, v in results.items()},
                      "cache_ratio": cache_ratio, "recompute_ratio": recompute_ratio,
                      f"decode_tokens_per_s_at_{hi}": results[hi]["decode_tokens_per_s"]}))


if __name__ == "__main__":
    main()
