"""Forward-only evaluation throughput vs training throughput of the same model on the same pool.

    python benchmarks/eval_bench.py                        # tiny-ep on 8 fake CPU devices (EP 4 x DP 2)
    python benchmarks/eval_bench.py --model d2048 --pool h200-1 --override n_layers=4 \\
        --override n_experts=64 --tokens-per-step 65536 --seq-len 4096

Training: the real train step (loss, grads, AdamW, router bias update) with the preset's transport.
Evaluation: the real eval path (marin.evaluation.evaluator.sequence_nll: packed windows of documents,
per-token NLL, per-document sums on the host) over documents of random length, counting predicted
tokens, with as many rows per batch as a training step. Both are timed after compilation.
Prints ``eval_vs_train_tokens_per_s`` (target >= 2: a forward pass is about a third of a training
step's FLOPs) and, last, one JSON object.
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
    add_model_flags(p, seq_len=128)
    p.add_argument("--steps", type=int, default=5, help="timed training steps")
    p.add_argument("--eval-tokens", type=int, default=None,
                   help="document tokens to evaluate (default: 20 training steps worth)")
    return p.parse_args()


def main() -> None:
    args = _parse()
    setup = train_setup(args)  # sets the pool's JAX environment before jax is imported
    import jax
    import jax.numpy as jnp
    import numpy as np

    from marin.evaluation.evaluator import sequence_nll
    from marin.evaluation.suite import default_batch_rows
    from marin.evaluation.windows import pack_windows
    from marin.parallel.mesh import place_host_arrays
    from marin.training.trainer import make_train_step, synthetic_batch

    config, cfg, data = setup["config"], setup["cfg"], setup["data"]
    mesh, host_state, shardings = setup["mesh"], setup["host_state"], setup["shardings"]
    sharding = setup["sharding"]
    batch_size = args.tokens_per_step // args.seq_len

    # --- training ---
    state = place_host_arrays(host_state, shardings)
    step = make_train_step(config, cfg, mesh, cfg.transport, shardings)
    lr = jnp.float32(1e-3)
    batches = [synthetic_batch(data, i, batch_size, args.seq_len) for i in range(args.steps + 2)]
    placed = [place_host_arrays((b["tokens"], b["segment_ids"]), sharding) for b in batches]
    for tokens, segs in placed[:2]:  # compile + one warm step
        state, m = step(state, tokens, segs, lr)
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for tokens, segs in placed[2:]:
        state, m = step(state, tokens, segs, lr)
    jax.block_until_ready((state, m))
    train_tps = args.steps * args.tokens_per_step / (time.perf_counter() - t0)

    # --- evaluation: documents of 20..3*seq_len tokens, packed, scored ---
    rng = np.random.default_rng(0)
    want = args.eval_tokens or 20 * args.tokens_per_step
    docs, n = [], 0
    while n < want:
        k = int(rng.integers(20, 3 * args.seq_len))
        docs.append(np.concatenate([[0], rng.integers(1, cfg.vocab_size, k)]).astype(np.int32))
        n += k
    rows_per_batch = default_batch_rows(args.tokens_per_step, args.seq_len, mesh)
    t_pack = time.perf_counter()
    rows = pack_windows(docs, args.seq_len).padded_to(rows_per_batch)
    pack_s = time.perf_counter() - t_pack
    params = jax.device_get(state["params"])
    bias = jax.device_get(state["router_bias"])
    warm = pack_windows(docs[:4], args.seq_len).padded_to(rows_per_batch)
    sequence_nll(params, bias, warm, 4, cfg, mesh, rows_per_batch)  # compile
    t0 = time.perf_counter()
    nll = sequence_nll(params, bias, rows, len(docs), cfg, mesh, rows_per_batch)
    eval_s = time.perf_counter() - t0
    eval_tps = n / eval_s
    ratio = eval_tps / train_tps
    fill = float((rows.sequence >= 0).mean())
    print(f"train {train_tps:.0f} tokens/s, eval {eval_tps:.0f} tokens/s (row fill {fill:.1%}, "
          f"packing {pack_s:.2f}s for {len(docs)} documents)", file=sys.stderr)
    print(f"eval_vs_train_tokens_per_s {ratio:.2f}")
    print(json.dumps({"model": args.model, "pool": args.pool, "backend": jax.default_backend(),
                      "seq_len": args.seq_len, "tokens_per_step": args.tokens_per_step,
                      "train_tokens_per_s": round(train_tps, 1), "eval_tokens_per_s": round(eval_tps, 1),
                      "eval_vs_train_tokens_per_s": round(ratio, 2), "row_fill": round(fill, 3),
                      "eval_loss": round(float(nll.sum() / n), 4)}))


if __name__ == "__main__":
    main()
