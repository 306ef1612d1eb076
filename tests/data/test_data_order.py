"""The without-replacement data order: exact-once coverage per epoch, closed-form cursors, shares,
host slices, resumes, the refusal of phases it cannot align, and the coverage report's math.

Reference implementations are the slow obvious loops; the token store is the data track's tiny one."""

from __future__ import annotations

import math

import numpy as np
import pytest

from marin.data.loader import MixtureLoader
from marin.data.mixture import MixtureConfig, MixtureStage
from marin.data.order import (
    WITH_REPLACEMENT,
    WITHOUT_REPLACEMENT_V1,
    Allocation,
    DataPhase,
    OrderError,
    WithoutReplacementOrder,
    block_length,
    coverage,
    data_schedule,
    domain_coverage,
    floor_sum,
    format_coverage,
    permute,
    stream_to_ring,
)

WEIGHTS = {"council": 4, "infra": 2, "web_code": 1, "science": 1}


# ---- pure math against loops ---------------------------------------------------------------------
def test_floor_sum_against_a_loop():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n, m, a = int(rng.integers(0, 200)), int(rng.integers(1, 500)), int(rng.integers(0, 1500))
        b = rng.integers(0, 4000, size=4)
        expect = [sum((a * t + int(bb)) // m for t in range(n)) for bb in b]
        assert floor_sum(n, m, a, b).tolist() == expect


def test_rows_per_step_are_within_one_row_and_sum_to_the_batch():
    rng = np.random.default_rng(1)
    for _ in range(20):
        shares = rng.random(int(rng.integers(1, 30))) ** 3
        shares[rng.random(shares.size) < 0.2] = 0.0
        if shares.sum() == 0:
            shares[0] = 1.0
        b = int(rng.integers(1, 300))
        alloc = Allocation.of(shares, b)
        ideal = shares / shares.sum() * b
        total = np.zeros(shares.size, dtype=np.int64)
        for t in range(200):
            assert alloc.rows_before(t).tolist() == total.tolist()  # closed form = the running sum
            rows = alloc.rows_at(t)
            assert rows.sum() == b and np.all(np.abs(rows - ideal) < 1 + 1e-9)
            assert np.all(rows[shares == 0] == 0)
            total += rows
        # cumulative shares stay close to the configured ones (a low-discrepancy rotation)
        assert np.max(np.abs(total - 200 * ideal)) <= 4.0


def test_permute_is_a_bijection_of_every_size():
    for m in [1, 2, 3, 5, 16, 17, 100, 1000, 4097]:
        out = permute(np.arange(m), np.full(m, m), np.full(m, 12345, dtype=np.uint64))
        assert sorted(out.tolist()) == list(range(m))
    a = permute(np.arange(50), np.full(50, 50), np.full(50, 1, dtype=np.uint64))
    b = permute(np.arange(50), np.full(50, 50), np.full(50, 2, dtype=np.uint64))
    assert a.tolist() != b.tolist() and a.tolist() != list(range(50))


def test_refuses_phase_lengths_that_are_not_multiples_of_the_shortest(mini_store):
    assert block_length([4096, 8192, 65536, 262144]) == 262144 and block_length([64, 128, 192]) == 384
    msg = ("seq_len_phases: 96 is not a multiple of the shortest phase length 64; the without_replacement_v1 "
           "data order needs every phase length to be a multiple of the shortest")
    with pytest.raises(OrderError) as e:
        block_length([64, 96])
    assert str(e.value) == msg and "\n" not in str(e.value)
    config = MixtureConfig(stores=(mini_store,), order=WITHOUT_REPLACEMENT_V1)
    with pytest.raises(OrderError, match="96 is not a multiple"):
        MixtureLoader(config, total_steps=10, schedule=data_schedule(10, 192, ((0.0, 64), (0.5, 96))))
    from marin.training.config import TrainConfig
    with pytest.raises(OrderError, match="96 is not a multiple"):
        TrainConfig(output_path="/tmp/x", data=config, tokens_per_step=192, seq_len_phases=((0.0, 64), (0.5, 96)))
    # the legacy order has nothing to align
    TrainConfig(output_path="/tmp/x", data=MixtureConfig(stores=(mini_store,)), tokens_per_step=192,
                seq_len_phases=((0.0, 64), (0.5, 96)))


# ---- the order on random schedules (pure, no store) ------------------------------------------------
def _marks_of_first_epochs(order: WithoutReplacementOrder, steps: int) -> list[np.ndarray]:
    """Visits of every training token by input positions of the windows of its source's first epoch,
    counted position by position (the slow obvious way), checking every window is contiguous text."""
    t = order.train_tokens
    offsets = np.concatenate([[0], np.cumsum(t)])
    flat = np.zeros(int(offsets[-1]), dtype=np.int64)
    for step in range(steps):
        src, stream, starts, seg = order.windows(step)
        i = np.arange(seg.seq_len)
        pos = stream[:, None] + i  # every input position of every window
        ring = (starts[:, None] + i) % t[src][:, None]
        s2 = np.broadcast_to(src[:, None], pos.shape)
        assert np.array_equal(stream_to_ring(pos.ravel(), t[s2].ravel(), order.block, order.seed, s2.ravel()),
                              ring.ravel()), "a window is not contiguous text"
        first = pos < t[src][:, None]
        np.add.at(flat, (offsets[s2] + ring)[first], 1)
    return [flat[offsets[k]:offsets[k + 1]] for k in range(t.size)]


@pytest.mark.parametrize("case", range(6))
def test_random_schedules_visit_every_token_once_per_epoch(case):
    rng = np.random.default_rng(100 + case)
    n_src = int(rng.integers(2, 7))
    base = int(rng.choice([4, 8]))
    lens = [base * int(m) for m in rng.choice([1, 2, 4], size=int(rng.integers(1, 4)))]
    # a few sources large enough to interleave several blocks
    block = block_length(lens)
    tokens = rng.integers(3 * block, 2200 * block if case % 2 else 40 * block, size=n_src)
    tokens_per_step = int(np.lcm.reduce(lens)) * int(rng.integers(2, 6))
    total = 400
    fractions = [0.0] + sorted(rng.choice(np.arange(1, 10) / 10, size=len(lens) - 1, replace=False).tolist())
    phases = data_schedule(total, tokens_per_step, list(zip(fractions, lens)))
    stage = int(rng.integers(1, total))
    probs = [tokens / tokens.sum(), rng.random(n_src) + 0.1]
    order = WithoutReplacementOrder(tokens, phases, [stage], probs, seed=case)
    # enough steps that every source finishes its first epoch
    steps = total
    while np.any(order.cursor(steps) < tokens + 2 * block) and steps < 200_000:
        steps *= 2
    if steps > 20_000:
        pytest.skip("schedule too slow to finish an epoch in a quick test")
    marks = _marks_of_first_epochs(order, steps)
    switches = sum(1 for a, b in zip(phases, phases[1:]) if a.seq_len != b.seq_len)
    for s, m in enumerate(marks):
        assert m.max() == 1, f"a token of source {s} is an input position of two windows in one epoch"
        skipped = int((m == 0).sum())
        # at each switch of length: less than one window of each length per interleaved block
        assert skipped <= switches * order.k[s] * 2 * max(lens), (s, skipped, order.k[s])


def test_a_long_lived_order_equals_a_fresh_one_at_random_steps():
    rng = np.random.default_rng(5)
    tokens = rng.integers(10_000, 400_000, size=12)
    args = (tokens, data_schedule(5000, 512, ((0.0, 16), (0.3, 32), (0.9, 128))), [1500, 4000],
            [tokens / tokens.sum(), rng.random(12), rng.random(12)], 9)
    long_lived = WithoutReplacementOrder(*args)
    for step in sorted(rng.integers(0, 6000, size=40).tolist()):
        fresh = WithoutReplacementOrder(*args)
        for a, b in zip(long_lived.plan(step), fresh.plan(step)):
            assert np.array_equal(a, b)


def test_cursors_are_the_sum_of_the_rows_of_past_steps():
    rng = np.random.default_rng(6)
    tokens = rng.integers(1_000, 50_000, size=7)
    phases = (DataPhase(0, 16, 8), DataPhase(37, 32, 8), DataPhase(90, 8, 32))  # a change of tokens per step too
    order = WithoutReplacementOrder(tokens, phases, [60], [tokens / tokens.sum(), rng.random(7)], 1)
    consumed = np.zeros(7, dtype=np.int64)
    for step in range(150):
        assert order.consumed(step).tolist() == consumed.tolist()
        src, _, b, ln = order.plan(step)
        assert src.size == b
        np.add.at(consumed, src, ln)


# ---- on a real token store --------------------------------------------------------------------------
def _config(store: str, **kw) -> MixtureConfig:
    return MixtureConfig(stores=(store,), seed=3, order=WITHOUT_REPLACEMENT_V1, **kw)


def _reference_streams(loader: MixtureLoader) -> list[np.ndarray]:
    return [r.read(0, int(n)) for r, n in zip(loader.readers, loader.train_tokens)]


def test_exact_once_at_one_epoch_on_a_store_across_a_seq_len_and_a_stage_switch(mini_store):
    """Natural shares: after about one epoch in total, every source's first epoch has given every one of
    its tokens to exactly one window (less the alignment at the switch), marked from ``plan``."""
    probe = MixtureLoader(_config(mini_store))
    total_train = int(probe.train_tokens.sum())
    tokens_per_step = 512
    total = math.ceil(total_train / tokens_per_step) + 40  # a little over one epoch: every source completes it
    stages = (MixtureStage(start_fraction=0.6, quality_weights={"q1": 1, "q2": 1, "q3": 1, "q4": 1, "q5": 1}),)
    schedule = data_schedule(total, tokens_per_step, ((0.0, 16), (0.4, 32)))
    loader = MixtureLoader(_config(mini_store, stages=stages), total_steps=total, schedule=schedule)
    order = loader.data_order()
    streams = _reference_streams(loader)
    t = loader.train_tokens
    marks = [np.zeros(int(n), dtype=np.int64) for n in t]
    last = np.zeros(t.size, dtype=np.int64)  # each source's cursor after its last step inside its first epoch
    for step in range(total):
        phase = [p for p in schedule if p.start_step <= step][-1]
        src, starts = loader.plan(step, phase.batch_size, phase.seq_len)
        assert src.size == phase.batch_size
        within = order.cursor(step + 1) <= t  # the steps whose windows all lie in the first epoch
        last = np.where(within, order.cursor(step + 1), last)
        b = loader.batch(step, phase.batch_size, phase.seq_len)
        for r, (s, x) in enumerate(zip(src.tolist(), starts.tolist())):
            ring = (x + np.arange(phase.seq_len + 1)) % t[s]
            np.testing.assert_array_equal(b["tokens"][r], streams[s][ring].astype(np.int32))
            if within[s]:
                np.add.at(marks[s], ring[:-1], 1)
    for s, m in enumerate(marks):
        assert m.max() == 1, loader.source_names[s]
        assert (m == 0).sum() <= 32 + t[s] - last[s], loader.source_names[s]
    # the real check of the whole first epoch: stream positions counted one by one
    marks = _marks_of_first_epochs(order, total + 40)
    for s, m in enumerate(marks):
        assert m.max() == 1 and (m == 0).sum() <= 32, (loader.source_names[s], (m == 0).sum())
    seen = sum(int((m > 0).sum()) for m in marks) / int(t.sum())
    assert seen >= 0.99


def test_host_slices_resumes_and_fresh_loaders_give_the_same_rows(mini_store):
    schedule = data_schedule(300, 256, ((0.0, 16), (0.5, 32)))
    config = _config(mini_store, domain_weights=WEIGHTS, stages=(MixtureStage(start_fraction=0.3, quality_weights={
        "q1": 0, "q2": 1, "q3": 2, "q4": 3, "q5": 4}),))
    long_lived = MixtureLoader(config, total_steps=300, schedule=schedule)
    rng = np.random.default_rng(0)
    uninterrupted = {}
    for step in range(0, 300, 7):  # an uninterrupted run's batches
        p = [p for p in schedule if p.start_step <= step][-1]
        uninterrupted[step] = long_lived.batch(step, p.batch_size, p.seq_len)["tokens"]
    resumed = MixtureLoader(config, total_steps=300, schedule=schedule)  # a new process resumed at step 147
    for step in [s for s in uninterrupted if s >= 147]:
        p = [p for p in schedule if p.start_step <= step][-1]
        np.testing.assert_array_equal(resumed.batch(step, p.batch_size, p.seq_len)["tokens"], uninterrupted[step])
    for step in rng.choice(sorted(uninterrupted), size=6, replace=False).tolist():
        p = [p for p in schedule if p.start_step <= step][-1]
        fresh = MixtureLoader(config, total_steps=300, schedule=schedule)
        whole = fresh.batch(step, p.batch_size, p.seq_len)
        np.testing.assert_array_equal(whole["tokens"], uninterrupted[step])
        for hosts in (2, 4, 8):
            per = p.batch_size // hosts
            parts = [long_lived.batch(step, p.batch_size, p.seq_len, rows=slice(h * per, (h + 1) * per))
                     for h in range(hosts)]
            np.testing.assert_array_equal(np.concatenate([x["tokens"] for x in parts]), whole["tokens"])
            np.testing.assert_array_equal(np.concatenate([x["segment_ids"] for x in parts]), whole["segment_ids"])
    with pytest.raises(ValueError, match="scheduled as 16 rows of 16 tokens"):
        long_lived.plan(0, 8, 32)


def test_realised_shares_follow_the_configured_ones(mini_store):
    loader = MixtureLoader(_config(mini_store, domain_weights=WEIGHTS))
    expected = np.array([loader.effective_shares().get(n, 0.0) for n in loader.source_names])
    b, counts = 64, np.zeros(len(loader.source_names))
    for step in range(1000):
        src, _ = loader.plan(step, b, 16)
        rows = np.bincount(src, minlength=counts.size)
        assert np.all(np.abs(rows - expected * b) < 1 + 1e-9)  # within one row per source every step
        counts += rows
    assert np.max(np.abs(counts - expected * b * 1000)) <= 4.0  # and within a few rows over 1,000 steps
    consumed = loader.tokens_consumed(1000, b, 16)
    assert [consumed[n] for n in loader.source_names] == (counts * 16).astype(int).tolist()


def test_rows_of_a_batch_are_mixed(mini_store):
    loader = MixtureLoader(_config(mini_store))
    src, _ = loader.plan(3, 64, 16)
    assert not np.all(np.diff(src) >= 0)  # shuffled: not grouped by source
    hosts = np.split(src, 4)
    assert all(len(set(h.tolist())) > 4 for h in hosts)


def test_the_legacy_order_is_unchanged(mini_store):
    old = MixtureLoader(MixtureConfig(stores=(mini_store,), seed=3))
    assert old.order == WITH_REPLACEMENT
    src, starts = old.plan(5, 32)
    assert np.array_equal(src, old.plan(5, 32, 128)[0]) and np.array_equal(starts, old.plan(5, 32, 128)[1])


# ---- coverage --------------------------------------------------------------------------------------------
def test_coverage_against_simulation_and_by_hand():
    rows = coverage({"a/q1": 1000, "a/q2": 3000, "b/q1": 100}, {"a/q1": 500, "a/q2": 3000, "b/q1": 550})
    by = {r["source"]: r for r in rows}
    assert by["a/q1"]["epochs"] == pytest.approx(0.5) and by["a/q1"]["seen"] == pytest.approx(0.5)
    assert by["a/q2"]["repeated"] == pytest.approx(0.0) and by["a/q2"]["max_visits"] == 1
    assert by["b/q1"]["epochs"] == pytest.approx(5.5) and by["b/q1"]["warning"] and by["b/q1"]["repeated"] == 1.0
    dom = {d["domain"]: d for d in domain_coverage(rows)}
    assert dom["a"]["seen"] == pytest.approx((500 + 3000) / 4000) and dom["b"]["warning"]
    text = format_coverage(domain_coverage(rows), WITHOUT_REPLACEMENT_V1, "test")
    assert "warning: b is read 5.5 epochs" in text
    # with replacement: Poisson visits, checked against a simulation
    rng = np.random.default_rng(0)
    n, e = 20_000, 0.78
    visits = np.bincount(rng.integers(0, n, size=int(e * n)), minlength=n)
    r = coverage({"x": n}, {"x": e * n}, WITH_REPLACEMENT)[0]
    assert abs(r["seen"] - np.mean(visits > 0)) < 0.01 and abs(r["repeated"] - np.mean(visits > 1)) < 0.01


def test_large_sources_interleave_blocks_and_still_visit_each_token_once():
    tokens = np.array([4200 * 16, 2100 * 16, 700 * 16])
    phases = data_schedule(900, 256, ((0.0, 8), (0.5, 16)))
    order = WithoutReplacementOrder(tokens, phases, [], [tokens / tokens.sum()], seed=4)
    assert order.k.tolist() == [4, 2, 1]
    src, stream, _, seg = order.windows(10)
    places = {s: len(set((stream[src == s] // order.block).tolist())) for s in range(3)}
    assert places[0] >= 4 and places[1] >= 2  # one step's rows of a big source come from several blocks
    marks = _marks_of_first_epochs(order, 900)
    for s, m in enumerate(marks):
        assert m.max() == 1 and (m == 0).sum() <= order.k[s] * 2 * 16


def test_the_mixture_report_shows_coverage_and_warns_past_four_epochs(mini_store, tmp_path):
    import json

    from marin.data.mixture_report import MixtureReportConfig, mixture_report

    config = _config(mini_store, domain_weights={"council": 1, "science": 20})
    total = MixtureLoader(config).train_tokens.sum()
    mixture_report(MixtureReportConfig(config, str(tmp_path), total_tokens=int(total), total_steps=100))
    cov = json.loads((tmp_path / "mixture_report.json").read_text())["coverage"]
    assert cov["order"] == WITHOUT_REPLACEMENT_V1
    dom = {d["domain"]: d for d in cov["domains"]}
    assert dom["science"]["epochs"] > 4 and dom["science"]["warning"] and dom["science"]["seen"] == 1.0
    assert dom["infra"]["epochs"] == 0 and dom["council"]["epochs"] < 1
    assert any(w.startswith("science/") for w in cov["warnings"]) and "warning: science" in cov["summary"]


def test_marin_plan_prints_the_hero_s_data_coverage(capsys):
    from marin.cli import main as marin

    marin(["plan", "hero", "--pool", "gb200-11racks"])
    out = capsys.readouterr().out
    block = out[out.index("data coverage"):]
    assert "reads 18.00T of 23.11T training tokens (0.78 epochs)" in block and "every token at most once" in block
    assert "council            0.78 epochs" in block
