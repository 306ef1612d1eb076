"""Data-order benchmark: the without-replacement order against the legacy with-replacement order.

    python benchmarks/data_order_bench.py                  # about 5 minutes on 2 cores
    python benchmarks/data_order_bench.py --loader_mb 0    # without the loader-vs-memcpy part (~30 s)

1. Coverage, on a real token store shaped like the quickstart's (a K40 miniature of 1 MB: 40 domains x
   5 quality buckets = 200 sources, ~520K training tokens), a proportional mixture, 4,096 tokens per
   step, 64-token windows for the first 40% of an epoch, then 128. Every input position of every
   window of ``MixtureLoader.plan`` is marked on its source's tokens:

   - both orders, after drawing one epoch of tokens: the share of the training tokens seen, seen more
     than once, and the most windows one token sat in;
   - the without-replacement order, run until every source has finished its second epoch: per epoch,
     the share of each source's tokens that were an input position (``coverage_at_one_epoch``: the
     first epoch; what is missing was skipped at the switch of length, less than one window per
     source) and the most windows one token sat in within one epoch (``max_windows_per_token_in_epoch``).

2. Shares: 1,000 steps at the hero's batch (11,264 rows of 4,096) of a quality-weighted mixture
   (the hero's bucket weights) on the same 200 sources: the realised token share of each source
   against the configured one (``share_error_max``, absolute), both orders.

3. Cost of ``plan`` at the hero's batch (11,264 rows, 200 sources) at step 390,000 of a 390,139-step
   run (its stage switch at 30%): microseconds per row, at step 0 too (``plan`` is closed form: it
   does not grow with the step), against the legacy order's draws. Also the order alone on Harrier
   K40's sizes (23.11T tokens in 200 sources) under the hero's schedule (4K -> 8K -> 65K -> 262K), and
   the tokens its three switches of length skip.

4. The loader (``benchmarks/data_bench.py``'s ``bench_loader``: whole batches, 64 x 4,096, read from
   memory-mapped shards, best of five passes of 256 consecutive steps, so each pass plans one chunk of
   steps) against a memcpy of as many bytes, both orders, on a larger store (``--loader_mb`` of text
   over 4 domains, so the store exceeds the L3 cache; its 20 sources are also the coverage part's
   second store). Target >= 0.25x.

Prints a table; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from data_bench import DOMAINS, bench_loader  # noqa: E402  (the benchmarks folder is on sys.path)

from marin.data.corpus_steps import CorpusInput  # noqa: E402
from marin.data.k40 import K40_DOMAINS, K40_TOTAL_TOKENS, QUALITY_BUCKETS, source_name  # noqa: E402
from marin.data.loader import PLAN_CHUNK_ROWS, MixtureLoader  # noqa: E402
from marin.data.mixture import MixtureConfig, MixtureStage, source_probabilities  # noqa: E402
from marin.data.order import (  # noqa: E402
    WITH_REPLACEMENT,
    WITHOUT_REPLACEMENT_V1,
    WithoutReplacementOrder,
    data_schedule,
)
from marin.data.synthetic import BUCKET_FRACTION, SyntheticK40Config, generate_k40_miniature  # noqa: E402
from marin.data.tokenize import TokenizeConfig, tokenize  # noqa: E402
from marin.data.tokenizer import TrainTokenizerConfig, train_tokenizer  # noqa: E402

HERO_STEPS = 390_139
HERO_ROWS = 11_264
HERO_PHASES = ((0.0, 4096), (0.5, 8192), (0.95, 65536), (0.99, 262144))
HERO_QUALITY_WEIGHTS = {"q1": 0.25, "q2": 0.5, "q3": 1.0, "q4": 2.0, "q5": 4.0}
HERO_STAGE2_FRACTION = 0.3


def build_store(work: Path, mb: float, vocab: int, domains: tuple[str, ...] | None) -> str:
    """A K40 miniature, its tokenizer and its token store, in this process (no Ray); a store already in
    ``work`` (a kept ``--workdir``) is used as it is."""
    corpus, tok, store = str(work / "corpus"), str(work / "tok"), str(work / "store")
    if (work / "store" / "manifest.json").exists():
        return store
    generate_k40_miniature(SyntheticK40Config(corpus, total_bytes=int(mb * 1e6), seed=0, domains=domains))
    train_tokenizer(TrainTokenizerConfig(corpus, tok, vocab_size=vocab))
    tokenize(TokenizeConfig(corpus, tok, store, CorpusInput(show_progress=False, use_ray=False)))
    return store


def _shape_at(schedule, step: int):
    return [p for p in schedule if p.start_step <= step][-1]


def mark_windows(loader: MixtureLoader, schedule, steps: int, epochs: int | None) -> np.ndarray:
    """Visits of every training token (sources concatenated) by the input positions of the windows of
    steps ``0 .. steps-1`` of ``loader.plan``: one row per epoch of its source (``epochs``; the
    without-replacement order says which epoch each position is in), or one row for all (None)."""
    t = loader.train_tokens
    offsets = np.concatenate([[0], np.cumsum(t)])
    marks = np.zeros((epochs or 1, int(offsets[-1])), dtype=np.int32)
    order = loader.data_order() if epochs else None
    for step in range(steps):
        p = _shape_at(schedule, step)
        src, starts = loader.plan(step, p.batch_size, p.seq_len)
        i = np.arange(p.seq_len)
        ring = (starts[:, None] + i) % t[src][:, None]
        epoch = np.zeros(ring.shape, dtype=np.int64)
        if order is not None:
            # the plan's rows are the order's windows, shuffled: match them to read each position's epoch
            w_src, stream, w_starts, _ = order.windows(step)
            a = np.lexsort((starts, src))
            b = np.lexsort((w_starts, w_src))
            assert np.array_equal(src[a], w_src[b]) and np.array_equal(starts[a], w_starts[b])
            pos = np.empty_like(stream)
            pos[a] = stream[b]
            epoch = (pos[:, None] + i) // t[src][:, None]
        keep = epoch < marks.shape[0]
        np.add.at(marks, (epoch[keep], (offsets[src][:, None] + ring)[keep]), 1)
    return marks


def bench_coverage(store: str) -> dict:
    probe = MixtureLoader(MixtureConfig(stores=(store,), seed=0))
    t = probe.train_tokens
    tokens_per_step = 4096
    steps = math.ceil(int(t.sum()) / tokens_per_step)  # one epoch of tokens drawn in all
    schedule = data_schedule(steps, tokens_per_step, ((0.0, 64), (0.4, 128)))
    out: dict = {"store_sources": int(t.size), "store_train_tokens": int(t.sum()), "one_epoch_steps": steps}
    t0 = time.perf_counter()
    for order in (WITH_REPLACEMENT, WITHOUT_REPLACEMENT_V1):
        loader = MixtureLoader(MixtureConfig(stores=(store,), seed=0, order=order), total_steps=steps,
                               schedule=schedule if order == WITHOUT_REPLACEMENT_V1 else None)
        visits = mark_windows(loader, schedule, steps, None)[0]
        out[order] = {"seen": float(np.mean(visits > 0)), "seen_twice_or_more": float(np.mean(visits > 1)),
                      "max_windows_per_token": int(visits.max())}
    # the without-replacement order until every source has finished its second epoch (the last
    # phase's shape continues past the planned steps)
    loader = MixtureLoader(MixtureConfig(stores=(store,), seed=0, order=WITHOUT_REPLACEMENT_V1), total_steps=steps,
                           schedule=schedule)
    order = loader.data_order()
    longer = steps
    while np.any(order.cursor(longer) < 2 * t + order.block):
        longer += 1
    marks = mark_windows(loader, schedule, longer, 2)
    offsets = np.concatenate([[0], np.cumsum(t)])
    per_source = [np.mean(marks[0, offsets[s]:offsets[s + 1]] > 0) for s in range(t.size)]
    out["epochs_run_steps"] = longer
    out["coverage_per_epoch"] = [float(np.mean(m > 0)) for m in marks]
    out["coverage_at_one_epoch"] = out["coverage_per_epoch"][0]
    out["coverage_at_one_epoch_worst_source"] = float(min(per_source))
    out["max_windows_per_token_in_epoch"] = int(marks.max())
    out["skipped_tokens_first_epoch"] = int(np.sum(marks[0] == 0))
    out["coverage_s"] = time.perf_counter() - t0
    return out


def hero_mixture(store: str, order: str) -> MixtureConfig:
    """Harrier K40's domain shares (every source at its size), quality-weighted from 30% of the run on."""
    return MixtureConfig(stores=(store,), seed=0, order=order,
                         stages=(MixtureStage(start_fraction=HERO_STAGE2_FRACTION,
                                              quality_weights=HERO_QUALITY_WEIGHTS),))


def bench_shares(store: str, steps: int = 1000) -> dict:
    out = {}
    for order in (WITH_REPLACEMENT, WITHOUT_REPLACEMENT_V1):
        config = MixtureConfig(stores=(store,), seed=0, order=order, quality_weights=HERO_QUALITY_WEIGHTS)
        loader = MixtureLoader(config)
        expected = np.array([loader.effective_shares().get(n, 0.0) for n in loader.source_names])
        rows = np.zeros(expected.size)
        for step in range(steps):
            rows += np.bincount(loader.plan(step, HERO_ROWS, 4096)[0], minlength=expected.size)
        realised = rows / rows.sum()
        out[order] = {"share_error_max": float(np.max(np.abs(realised - expected))),
                      "rows_error_max": float(np.max(np.abs(rows - expected * HERO_ROWS * steps))),
                      "relative_error_max": float(np.max(np.abs(realised - expected) / expected))}
    return out


def _us_per_row(fn, steps: list[int], rows: int, rounds: int = 5) -> float:
    """Microseconds per row of the fastest of ``rounds`` passes over ``steps`` (the box is shared)."""
    fn(steps[0])
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for s in steps:
            fn(s)
        best = min(best, (time.perf_counter() - t0) / len(steps))
    return best / rows * 1e6


def bench_plan(store: str) -> dict:
    out: dict = {}
    schedule = data_schedule(HERO_STEPS, HERO_ROWS * 4096, ((0.0, 4096),))
    for order in (WITH_REPLACEMENT, WITHOUT_REPLACEMENT_V1):
        loader = MixtureLoader(hero_mixture(store, order), total_steps=HERO_STEPS,
                               schedule=schedule if order == WITHOUT_REPLACEMENT_V1 else None)
        for at in (0, 390_000):
            out[f"{order}_step_{at}"] = _us_per_row(lambda s, ld=loader: ld.plan(s, HERO_ROWS, 4096),
                                                    list(range(at, at + 10)), HERO_ROWS)
    # the order alone on Harrier K40's sizes (bucket sizes by the miniature's bucket fractions: the
    # published corpus gives domain sizes only) under the hero's schedule of lengths
    names = [source_name(d.name, b) for d in K40_DOMAINS for b in QUALITY_BUCKETS]
    sizes = np.array([K40_TOTAL_TOKENS * d.share * BUCKET_FRACTION[b] for d in K40_DOMAINS for b in QUALITY_BUCKETS])
    sizes = (sizes / sizes.sum() * K40_TOTAL_TOKENS).astype(np.int64)
    probs = [source_probabilities(names, sizes.tolist(), None, q) for q in (None, HERO_QUALITY_WEIGHTS)]
    phases = data_schedule(HERO_STEPS, HERO_ROWS * 4096, HERO_PHASES)
    t0 = time.perf_counter()
    order = WithoutReplacementOrder(sizes, phases, [math.ceil(HERO_STAGE2_FRACTION * HERO_STEPS)], probs, seed=0)
    out["k40_order_build_s"] = time.perf_counter() - t0
    for at in (100_000, 300_000, 390_000):
        p = _shape_at(phases, at)
        out[f"k40_hero_schedule_step_{at}"] = {
            "rows": p.batch_size, "seq_len": p.seq_len,
            "us_per_row": _us_per_row(order.plan, list(range(at, at + 10)), p.batch_size)}
    end = HERO_STEPS
    skipped = order.cursor(end) - order.consumed(end)  # the cursor counts what the switches skip
    out["k40_tokens_read"] = float(order.consumed(end).sum())
    out["k40_skipped_tokens"] = float(skipped.sum())
    out["k40_skipped_share_of_read"] = float(skipped.sum() / order.consumed(end).sum())
    out["k40_max_source_epochs"] = float(np.max(order.consumed(end) / sizes))
    out["k40_interleaved_blocks"] = int(order.k.max())
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=1.0, help="text of the 200-source store (the quickstart's: 1 MB)")
    ap.add_argument("--loader_mb", type=float, default=48.0, help="text of the loader benchmark's store; 0: skip")
    # five timed passes (data_bench's best-of-5) of one chunk of planned steps each: every pass pays
    # its share of planning
    ap.add_argument("--batches", type=int, default=5 * (PLAN_CHUNK_ROWS // 64), help="loader batches timed")
    ap.add_argument("--loader_repeats", type=int, default=3, help="loader measurements per order (best kept)")
    ap.add_argument("--workdir", default=None, help="keep files here (default: a temp dir, removed)")
    args = ap.parse_args(argv)

    work = Path(args.workdir or tempfile.mkdtemp(prefix="data_order_bench_"))
    try:
        t0 = time.perf_counter()
        store = build_store(work / "small", args.mb, 512, None)
        build_s = time.perf_counter() - t0
        covs = {"quickstart": bench_coverage(store)}
        shares = bench_shares(store)
        plan = bench_plan(store)
        loader: dict[str, float] = {}
        loader_runs: dict[str, list[float]] = {}
        if args.loader_mb > 0:
            big = build_store(work / "big", args.loader_mb, 8192, DOMAINS)
            covs["large"] = bench_coverage(big)
            # the orders take turns, and each keeps its best ratio: on a shared machine the least
            # disturbed passes, alike for both
            for _ in range(args.loader_repeats):
                for order in (WITH_REPLACEMENT, WITHOUT_REPLACEMENT_V1):
                    ld = bench_loader(big, 64, 4096, args.batches, order)
                    ratio = ld["loader_tokens_per_s"] / ld["memcpy_tokens_per_s"]
                    loader[order] = max(loader.get(order, 0.0), ratio)
                    loader_runs.setdefault(order, []).append(ratio)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)

    # the headline coverage: the larger store when there is one (the quickstart's sources are ~2,600
    # tokens, so one skipped 64-token half-window at the switch is 2.5% of such a source)
    cov = covs.get("large", covs["quickstart"])
    new, old = cov[WITHOUT_REPLACEMENT_V1], cov[WITH_REPLACEMENT]
    result = {
        "coverage_at_one_epoch": cov["coverage_at_one_epoch"],
        "coverage_at_one_epoch_worst_source": cov["coverage_at_one_epoch_worst_source"],
        "coverage_second_epoch": cov["coverage_per_epoch"][1],
        "coverage_at_one_epoch_quickstart_store": covs["quickstart"]["coverage_at_one_epoch"],
        "max_windows_per_token_in_epoch": max(c["max_windows_per_token_in_epoch"] for c in covs.values()),
        "one_epoch_drawn_seen": new["seen"], "one_epoch_drawn_seen_legacy": old["seen"],
        "one_epoch_drawn_seen_vs_legacy": new["seen"] / old["seen"],
        "one_epoch_drawn_seen_twice": new["seen_twice_or_more"],
        "one_epoch_drawn_seen_twice_legacy": old["seen_twice_or_more"],
        "max_windows_per_token_legacy": old["max_windows_per_token"],
        "share_error_max": shares[WITHOUT_REPLACEMENT_V1]["share_error_max"],
        "share_error_max_legacy": shares[WITH_REPLACEMENT]["share_error_max"],
        "share_error_legacy_vs_order": shares[WITH_REPLACEMENT]["share_error_max"]
        / max(shares[WITHOUT_REPLACEMENT_V1]["share_error_max"], 1e-12),
        "share_rows_error_max": shares[WITHOUT_REPLACEMENT_V1]["rows_error_max"],
        "share_rows_error_max_legacy": shares[WITH_REPLACEMENT]["rows_error_max"],
        "plan_us_per_row": plan[f"{WITHOUT_REPLACEMENT_V1}_step_390000"],
        "plan_us_per_row_step_0": plan[f"{WITHOUT_REPLACEMENT_V1}_step_0"],
        "plan_us_per_row_legacy": plan[f"{WITH_REPLACEMENT}_step_390000"],
        "plan_vs_legacy": plan[f"{WITHOUT_REPLACEMENT_V1}_step_390000"] / plan[f"{WITH_REPLACEMENT}_step_390000"],
        "loader_vs_memcpy": loader.get(WITHOUT_REPLACEMENT_V1),
        "loader_vs_memcpy_legacy": loader.get(WITH_REPLACEMENT),
        "k40_skipped_share_of_read": plan["k40_skipped_share_of_read"],
        "details": {"coverage": covs, "shares": shares, "plan": plan, "store_build_s": build_s,
                    "loader_vs_memcpy_runs": loader_runs},
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    rows = []
    for name, c in covs.items():
        n, o = c[WITHOUT_REPLACEMENT_V1], c[WITH_REPLACEMENT]
        rows += [
            (f"{name} store", f"{c['store_sources']} sources, {c['store_train_tokens']:,} training tokens; one epoch "
                              f"= {c['one_epoch_steps']} steps of 4,096 tokens (64-token windows, 128 from 40%)"),
            ("  one epoch drawn: tokens seen", f"{n['seen']:.4f}  (legacy {o['seen']:.4f}: "
                                              f"{n['seen'] / o['seen']:.2f}x)"),
            ("  one epoch drawn: seen twice or more", f"{n['seen_twice_or_more']:.4f}  "
                                                      f"(legacy {o['seen_twice_or_more']:.4f})"),
            ("  one epoch drawn: most windows on a token", f"{n['max_windows_per_token']}  "
                                                           f"(legacy {o['max_windows_per_token']})"),
            ("  coverage of each source's 1st / 2nd epoch", f"{c['coverage_per_epoch'][0]:.5f} / "
                                                            f"{c['coverage_per_epoch'][1]:.5f}  (worst source "
                                                            f"{c['coverage_at_one_epoch_worst_source']:.4f})"),
            ("  most windows on a token within an epoch", f"{c['max_windows_per_token_in_epoch']}  (target 1)"),
        ]
    k40 = plan
    rows += [
        ("share error after 1,000 hero batches", f"{result['share_error_max']:.2e}  (legacy "
                                                 f"{result['share_error_max_legacy']:.2e}: "
                                                 f"{result['share_error_legacy_vs_order']:.0f}x larger)"),
        ("  in rows of 11,264,000", f"{result['share_rows_error_max']:.1f}  (legacy "
                                    f"{result['share_rows_error_max_legacy']:.1f})"),
        ("plan, 11,264 rows, step 390,000", f"{result['plan_us_per_row']:.3f} us/row  (step 0: "
                                            f"{result['plan_us_per_row_step_0']:.3f}; legacy "
                                            f"{result['plan_us_per_row_legacy']:.3f}: "
                                            f"{result['plan_vs_legacy']:.2f}x)"),
        ("order on K40 sizes, hero schedule", ", ".join(
            f"step {a:,}: {h['rows']} x {h['seq_len']} {h['us_per_row']:.2f} us/row"
            for a, h in ((a, k40[f"k40_hero_schedule_step_{a}"]) for a in (100_000, 300_000, 390_000)))),
        ("  tokens skipped at the 3 switches", f"{k40['k40_skipped_tokens'] / 1e9:.3f}B of "
                                              f"{k40['k40_tokens_read'] / 1e12:.2f}T read "
                                              f"({k40['k40_skipped_share_of_read']:.1e})"),
    ]
    if loader:
        rows.append(("loader vs memcpy (target >= 0.25)", f"{loader[WITHOUT_REPLACEMENT_V1]:.2f}x  (legacy "
                                                           f"{loader[WITH_REPLACEMENT]:.2f}x)"))
    w = max(len(a) for a, _ in rows)
    print(f"data_order_bench  {result['date']}  {result['machine']}")
    for a, b in rows:
        print(f"  {a:<{w}}  {b}")

    def rounded(x):
        if isinstance(x, float):
            return float(f"{x:.6g}")
        if isinstance(x, dict):
            return {k: rounded(v) for k, v in x.items()}
        if isinstance(x, list):
            return [rounded(v) for v in x]
        return x

    print(json.dumps(rounded(result)))
    return result


if __name__ == "__main__":
    main()
