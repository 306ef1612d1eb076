"""Drops at the hero's routing shape: the fixed transport against the capacity-bounded ragged one.

    python benchmarks/drop_bench.py [--tokens-per-device 256] [--balance-steps 20] [--batches 4]

384 routed experts, top-8, expert parallelism 64 on 64 fake CPU devices in one process (mesh 1 x 64),
at a tiny width. Text: the K40-shaped miniature corpus (marin.data.synthetic, 40 domains x 5
quality buckets), tokenized by a byte-level BPE trained on it; each device holds one sequence of
``--tokens-per-device`` consecutive tokens of one document stream, as a training microbatch holds whole
sequences. The router is the model's (marin.models.router.route on a token + previous-token
embedding); its weights stay at their initialisation (there is no language-model loss here) and
its per-expert bias is trained with quantile balancing (the published router's rule, from a global
histogram) for ``--balance-steps`` steps on training batches until the loads settle. Then, on the
same held-out batches, both transports run the routed experts: ``fixed`` at capacity factor 1.15
(per-expert receive buffers) and ``ragged_capacity`` at 1.15 with 2 chunks (pooled over 3 local
experts); their own drop counters give the fraction of assignments dropped, checked against the
slow reference rules (marin.models.reference) on the first batch.

The hero's microbatch is 8,192 tokens per device (4K phase, 8 microbatches); the default here is
256 (a batch of 16,384 tokens): on this shared 2-core machine (getting a tenth of a core) a run at
1,024 tokens per device did not finish in 20 minutes (7.1 GB resident: the emulated ragged
collective holds 64 worst-case blocks of the device's 8,192 assignments on each of the 64 devices);
``--tokens-per-device`` raises it where a machine allows. Fewer tokens per device make every
buffer's load noisier, so both transports drop more here than they would at the hero's size.

The last line is one JSON object: fixed_drop_fraction, ragged_drop_fraction, drop_ratio (fixed / ragged).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=64").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from marin.data.k40 import K40_DOMAINS, QUALITY_BUCKETS  # noqa: E402
from marin.data.synthetic import generate_documents  # noqa: E402
from marin.data.tokenizer import train_bpe_tokenizer  # noqa: E402
from marin.models.reference import fixed_transport_survivors, ragged_capacity_survivors  # noqa: E402
from marin.models.router import expert_load, quantile_bias_target, quantile_update, route  # noqa: E402
from marin.parallel.mesh import batch_sharding, make_mesh  # noqa: E402
from marin.parallel.transports import moe_experts  # noqa: E402

N_EXPERTS, TOP_K, EP, CF, CHUNKS = 384, 8, 64, 1.15, 2


def corpus_tokens(docs_per_source: int, vocab: int) -> np.ndarray:
    """The miniature corpus as one token stream: documents of every domain and bucket, shuffled by
    document (a training stream mixes domains), each ended by the end-of-text id 0."""
    docs = [d for dom in K40_DOMAINS for b in QUALITY_BUCKETS for d in generate_documents(dom.name, b, docs_per_source)]
    tok = train_bpe_tokenizer(docs[::7], vocab)
    order = np.random.default_rng(0).permutation(len(docs))
    ids = [np.asarray(tok.encode(docs[i]).ids + [0], np.int32) for i in order]
    return np.concatenate(ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens-per-device", type=int, default=256)
    p.add_argument("--balance-steps", type=int, default=20)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--width", type=int, default=16, help="latent width of the router input and the experts")
    p.add_argument("--docs-per-source", type=int, default=24)
    p.add_argument("--vocab", type=int, default=2048)
    args = p.parse_args()
    assert len(jax.devices()) == EP, "needs 64 fake devices (XLA_FLAGS set before JAX starts)"
    t0 = time.time()
    stream = corpus_tokens(args.docs_per_source, args.vocab)
    t_dev, d = args.tokens_per_device, args.width
    batch_tokens = EP * t_dev
    n_batches = stream.size // batch_tokens
    if n_batches < args.batches + 1:
        raise SystemExit(f"drop_bench: the corpus has {n_batches} batches of {batch_tokens:,} tokens; need "
                         f"{args.batches + 1} (raise --docs-per-source)")
    all_batches = [stream[i * batch_tokens:(i + 1) * batch_tokens] for i in range(n_batches)]
    held_out, train = all_batches[-args.batches:], all_batches[:-args.batches]  # measured on unseen text
    print(f"corpus: {stream.size:,} tokens ({time.time() - t0:.1f} s), {len(train)} training and "
          f"{len(held_out)} held-out batches of {batch_tokens:,} tokens")

    key = jax.random.key(0)
    ke, kp, kr, kx = jax.random.split(key, 4)
    emb = jax.random.normal(ke, (args.vocab, d)) / math.sqrt(d)
    prev_emb = jax.random.normal(kp, (args.vocab, d)) / math.sqrt(d)
    w_router = jax.random.normal(kr, (d, N_EXPERTS)) / math.sqrt(d)

    def router_input(tokens):
        prev = jnp.concatenate([jnp.zeros((1,), tokens.dtype), tokens[:-1]])
        return emb[tokens] + 0.5 * prev_emb[prev]

    @jax.jit
    def balance(bias, tokens):
        ids, _, scores = route(router_input(tokens), w_router, bias, TOP_K)
        load = expert_load(ids, N_EXPERTS)
        return quantile_update(bias, quantile_bias_target(scores, bias, TOP_K)), jnp.max(load) / jnp.mean(load)

    bias = jnp.zeros((N_EXPERTS,))
    for step in range(args.balance_steps):
        bias, imbalance = balance(bias, jnp.asarray(train[step % len(train)]))
        if step % 10 == 0 or step == args.balance_steps - 1:
            print(f"balance step {step}: max / mean expert load {float(imbalance):.3f}")

    mesh = make_mesh(1, EP)
    sharding = batch_sharding(mesh)
    experts = {n: jax.random.normal(k, s) / math.sqrt(d) for n, k, s in
               zip(("gate", "up", "down"), jax.random.split(kx, 3), ((N_EXPERTS, d, d),) * 3)}

    def drops(transport):
        @jax.jit
        def f(tokens, bias, experts):
            z = router_input(tokens)
            ids, w, _ = route(z, w_router, bias, TOP_K)
            ids, w, z = (jax.lax.with_sharding_constraint(a, sharding) for a in (ids, w, z))
            _, s = moe_experts(z, ids, w, experts, n_experts=N_EXPERTS, transport=transport, mesh=mesh,
                               capacity_factor=CF, expert_chunks=CHUNKS)
            return s, ids
        return f

    out = {}
    for transport in ("fixed", "ragged_capacity"):
        f = drops(transport)
        dropped = total = 0.0
        t1 = time.time()
        for b, tokens in enumerate(held_out):
            s, ids = f(jnp.asarray(tokens), bias, experts)
            dropped += float(s["send_drops"]) + float(s["recv_drops"])
            total += float(s["assignments"])
            if b == 0:  # the transport's counters against the slow reference rule
                rule = fixed_transport_survivors if transport == "fixed" else ragged_capacity_survivors
                extra = () if transport == "fixed" else (CHUNKS,)
                _, sd, rd = rule(np.asarray(ids), 1, EP, N_EXPERTS, CF, *extra)
                assert (sd, rd) == (float(s["send_drops"]), float(s["recv_drops"])), (transport, sd, rd, s)
        out[transport] = dropped / total
        print(f"{transport:16s} cf {CF}: {100 * dropped / total:.4f}% of {int(total):,} assignments dropped "
              f"({time.time() - t1:.1f} s)")
    ratio = out["fixed"] / out["ragged_capacity"] if out["ragged_capacity"] > 0 else float("inf")
    print(f"drop ratio fixed / ragged_capacity: {ratio:.1f}x (total {time.time() - t0:.0f} s)")
    print(json.dumps({"fixed_drop_fraction": out["fixed"], "ragged_drop_fraction": out["ragged_capacity"],
                      "drop_ratio": ratio if math.isfinite(ratio) else None, "tokens_per_device": t_dev,
                      "n_experts": N_EXPERTS, "top_k": TOP_K, "ep": EP, "capacity_factor": CF,
                      "expert_chunks": CHUNKS, "balance_steps": args.balance_steps, "batches": args.batches}))


if __name__ == "__main__":
    main()
