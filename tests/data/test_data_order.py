"""The without-replacement data order: exact-once coverage per epoch, closed-form cursors, shares,
host slices, resumes, the refusal of phases it cannot align, and the coverage report's math.

Reference implementations are the slow obvious loops; the token store is the data track's tiny one."""

from __future__ import annotations

import dataclasses
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
    TrainConfig(output_path="/tmp/x", data=MixtureConfig(stores=(mini_store,), order=WITH_REPLACEMENT),
                tokens_per_step=192, seq_len_phases=((0.0, 64), (0.5, 96)))


# ---- the order on random schedules (pure, no store) ------------------------------------------------
def _marks_by_epoch(order: WithoutReplacementOrder, steps: int, epochs: int = 1) -> list[np.ndarray]:
    """Visits of every training token by the input positions of the windows of steps ``0 .. steps-1``,
    per epoch of its source (``[epochs, tokens]`` per source; a window across an epoch's end counts
    in both), counted position by position (the slow obvious way), checking every window is
    contiguous text."""
    t = order.train_tokens
    offsets = np.concatenate([[0], np.cumsum(t)])
    flat = np.zeros(epochs * int(offsets[-1]), dtype=np.int64)
    for step in range(steps):
        src, stream, starts, seg = order.windows(step)
        i = np.arange(seg.seq_len)
        pos = stream[:, None] + i  # every input position of every window
        ring = (starts[:, None] + i) % t[src][:, None]
        s2 = np.broadcast_to(src[:, None], pos.shape)
        assert np.array_equal(stream_to_ring(pos.ravel(), t[s2].ravel(), order.block, order.seed, s2.ravel()),
                              ring.ravel()), "a window is not contiguous text"
        epoch = pos // t[src][:, None]
        keep = epoch < epochs
        np.add.at(flat, (epoch * offsets[-1] + offsets[src][:, None] + ring)[keep], 1)
    flat = flat.reshape(epochs, -1)
    return [flat[:, offsets[k]:offsets[k + 1]] for k in range(t.size)]


def _steps_to_finish(order: WithoutReplacementOrder, epochs: int) -> int:
    """The first step by which every source has finished the group of interleaved blocks holding the end
    of its ``epochs``-th epoch (a group's blocks are read in turn, so its first block ends last)."""
    group = order.k * order.block
    target = -(-(epochs * order.train_tokens) // group) * group

    def short(step: int) -> bool:
        return bool(np.any(order.cursor(step) < target))

    lo, hi = 0, 1
    while short(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if short(mid) else (lo, mid)
    return hi


@pytest.mark.parametrize("case", range(6))
def test_random_schedules_visit_every_token_once_per_epoch(case):
    """Random lengths (rising and falling), switch points, a stage switch and source sizes (from below
    one block to several interleaved blocks): in each of the first two epochs of every source, no
    token is an input position of two windows, and what is never visited was skipped at the switches
    of length (less than one new window per interleaved block each)."""
    rng = np.random.default_rng(100 + case)
    n_src = int(rng.integers(2, 7))
    base = int(rng.choice([4, 8]))
    lens = [base * int(m) for m in rng.choice([1, 2, 4], size=int(rng.integers(1, 4)))]
    block = block_length(lens)
    # a few sources large enough to interleave several blocks; some cases with one below a block
    tokens = rng.integers(3 * block, 2200 * block if case % 2 else 40 * block, size=n_src)
    if case % 3 == 0:
        tokens[0] = rng.integers(min(lens) // 2, block)  # windows may then be longer than the source
    tokens_per_step = int(np.lcm.reduce(lens)) * int(rng.integers(6, 16))
    total = 400
    fractions = [0.0] + sorted(rng.choice(np.arange(1, 10) / 10, size=len(lens) - 1, replace=False).tolist())
    phases = data_schedule(total, tokens_per_step, list(zip(fractions, lens)))
    stage = int(rng.integers(1, total))
    probs = [tokens / tokens.sum(), rng.random(n_src) + 0.1]
    order = WithoutReplacementOrder(tokens, phases, [stage], probs, seed=case)
    steps = _steps_to_finish(order, 2)
    assert steps < 12_000, "the schedule is too slow for a quick test"
    marks = _marks_by_epoch(order, steps, 2)
    new_lens = [b.seq_len for a, b in zip(phases, phases[1:]) if a.seq_len != b.seq_len]
    for s, m in enumerate(marks):
        assert m.max() == 1, f"a token of source {s} is an input position of two windows in one epoch"
        for e in range(2):
            skipped = int((m[e] == 0).sum())
            assert skipped <= sum(order.k[s] * n - 1 for n in new_lens), (s, e, skipped, order.k[s])


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
    """On the store: 16-token windows, then 32 from 40% of the run; natural shares, then cleaner buckets
    weighted up from 60%. Marked from ``plan`` position by position until every source has read two
    epochs: in each epoch every token is an input position of one window at most, and all but what
    the switch of length skipped (less than one 32-token window) of exactly one. Every batch holds the
    planned windows' text; every step gives each source its share to within one row."""
    probe = MixtureLoader(_config(mini_store))
    tokens_per_step = 512
    total = math.ceil(int(probe.train_tokens.sum()) / tokens_per_step)  # one epoch of tokens in all
    stages = (MixtureStage(start_fraction=0.6, quality_weights={"q1": 1, "q2": 1, "q3": 2, "q4": 2, "q5": 3}),)
    schedule = data_schedule(total, tokens_per_step, ((0.0, 16), (0.4, 32)))
    loader = MixtureLoader(_config(mini_store, stages=stages), total_steps=total, schedule=schedule)
    order = loader.data_order()
    assert order.k.max() == 1  # small sources: one block at a time
    t = loader.train_tokens
    offsets = np.concatenate([[0], np.cumsum(t)])
    text = np.concatenate(_reference_streams(loader)).astype(np.int32)
    steps = _steps_to_finish(order, 2)  # past the planned steps the last shape and stage go on
    marks = np.zeros((2, int(offsets[-1])), dtype=np.int64)
    stage_start = loader.stage_starts()[1]
    stage_rows = np.zeros((2, t.size))
    for step in range(steps):
        p = schedule[-1] if step >= total else [p for p in schedule if p.start_step <= step][-1]
        src, starts = loader.plan(step, p.batch_size, p.seq_len)
        rows = np.bincount(src, minlength=t.size)
        shares = np.array([loader.effective_shares(step).get(n, 0.0) for n in loader.source_names])
        assert np.all(np.abs(rows - shares * p.batch_size) < 1 + 1e-9)
        stage_rows[int(step >= stage_start)] += rows * p.seq_len
        ring = (starts[:, None] + np.arange(p.seq_len + 1)) % t[src][:, None]
        if step < total:  # the batch is the planned windows' text (the target token included)
            np.testing.assert_array_equal(loader.batch(step, p.batch_size, p.seq_len)["tokens"],
                                          text[offsets[src][:, None] + ring])
        # the plan's rows are the order's windows, shuffled: match them to read each position's epoch
        w_src, stream, w_starts, _ = order.windows(step)
        i, j = np.lexsort((starts, src)), np.lexsort((w_starts, w_src))
        assert np.array_equal(src[i], w_src[j]) and np.array_equal(starts[i], w_starts[j])
        pos = np.empty_like(stream)
        pos[i] = stream[j]
        epoch = (pos[:, None] + np.arange(p.seq_len)) // t[src][:, None]
        keep = epoch < 2
        np.add.at(marks, (epoch[keep], (offsets[src][:, None] + ring[:, :-1])[keep]), 1)
    for s, name in enumerate(loader.source_names):
        m = marks[:, offsets[s]:offsets[s + 1]]
        assert m.max() == 1, name
        assert (m[0] == 0).sum() < 32 and (m[1] == 0).sum() < 32, (name, (m == 0).sum(axis=1))
    assert (marks[0] > 0).mean() >= 0.99
    # each stage's tokens by source: its shares, to within a few windows (two segments in the first)
    shares = [np.array([loader.effective_shares(st).get(n, 0.0) for n in loader.source_names])
              for st in (0, stage_start)]
    for k in range(2):
        assert np.max(np.abs(stage_rows[k] - shares[k] * stage_rows[k].sum())) <= 4 * 32


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


def test_consecutive_steps_planned_together_equal_steps_planned_alone(mini_store):
    """A loader read step after step plans chunks of consecutive steps at once (clipped at every switch
    of length or stage); one asked the same steps backwards plans each alone: the same rows."""
    schedule = data_schedule(120, 256, ((0.0, 16), (0.5, 32)))
    config = _config(mini_store, stages=(MixtureStage(start_step=37, quality_weights={"q1": 0, "q2": 1}),))
    forwards = MixtureLoader(config, total_steps=120, schedule=schedule)
    backwards = MixtureLoader(config, total_steps=120, schedule=schedule)
    shape = {s: [p for p in schedule if p.start_step <= s][-1] for s in range(140)}
    ahead = {s: forwards.plan(s, shape[s].batch_size, shape[s].seq_len) for s in range(140)}
    for s in reversed(range(140)):
        alone = backwards.plan(s, shape[s].batch_size, shape[s].seq_len)
        assert np.array_equal(alone[0], ahead[s][0]) and np.array_equal(alone[1], ahead[s][1]), s
    order = forwards.data_order()
    src, _, starts, _ = order.windows_of_steps(60, 20)
    for i in range(20):
        assert np.array_equal(src[i], order.windows(60 + i)[0]) and np.array_equal(starts[i], order.windows(60 + i)[2])
    with pytest.raises(ValueError, match="not inside one segment"):
        order.windows_of_steps(55, 10)  # steps 55..64 cross the switch of length at step 60


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


def test_a_new_config_reads_the_current_order_and_an_old_record_the_legacy_one_under_another_hash(mini_store):
    """A ``MixtureConfig`` built today reads without replacement; a record written before ``order``
    existed reads back (and resumes) as the legacy order and keeps its hash, which no new config has."""
    from marin.execution import ExecutorStep, plan_steps
    from marin.execution.jsonable import to_jsonable
    from marin.training.config import TrainConfig, train_config_from_record
    from marin.training.trainer import data_order_of

    assert MixtureConfig(stores=(mini_store,)).order == WITHOUT_REPLACEMENT_V1
    assert MixtureLoader(MixtureConfig(stores=(mini_store,))).order == WITHOUT_REPLACEMENT_V1
    record = to_jsonable(TrainConfig(output_path="/runs/a", data=MixtureConfig(stores=(mini_store,), seed=3)))
    del record["data"]["order"]  # as a run recorded before the field existed wrote it
    old = train_config_from_record(record)
    assert old.data.order == WITH_REPLACEMENT and data_order_of(old.data) == WITH_REPLACEMENT  # its resume check
    new = MixtureConfig(stores=(mini_store,), seed=3)

    def planned(config: MixtureConfig):
        return plan_steps([ExecutorStep("data/mixture", print, config)], "/p").steps[0]

    before, now = planned(old.data), planned(new)
    assert "order" not in before.config_leaves and "order" in now.config_leaves
    assert before.hash != now.hash
    assert before.hash == planned(dataclasses.replace(new, order=WITH_REPLACEMENT)).hash


def test_the_legacy_order_is_unchanged(mini_store):
    old = MixtureLoader(MixtureConfig(stores=(mini_store,), seed=3, order=WITH_REPLACEMENT))
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
    assert "warning: b/q1 is read 5.5 epochs" in text
    # a domain whose mean is under the limit names the source that is past it, with its own epochs
    skewed = coverage({"c/q1": 1000, "c/q5": 100}, {"c/q1": 1000, "c/q5": 470})
    (line,) = [x for x in format_coverage(domain_coverage(skewed), WITHOUT_REPLACEMENT_V1, "test").splitlines()
               if "warning" in x]
    assert line == ("  warning: c/q5 is read 4.7 epochs (more than 4: repeated data is worth much less beyond "
                    "that; its domain c 1.3 on average)")
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
    marks = [m[0] for m in _marks_by_epoch(order, 900)]
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



# ---- the trainer ----------------------------------------------------------------------------------------
@pytest.mark.slow  # three short training runs: two compiles each
def test_a_resumed_training_run_reads_what_an_uninterrupted_one_reads_and_keeps_its_order(mini_store, tmp_path,
                                                                                          monkeypatch,
                                                                                          stop_after_checkpoint):
    """Through the trainer (phases 16 -> 32): a run stopped after its step-2 checkpoint and rerun reads the
    batches an uninterrupted run reads, and ends on the same bytes; its checkpoints name the order, and a
    rerun under another order is refused."""
    from marin.models.config import get_preset
    from marin.training.checkpoint import read_checkpoint
    from marin.training.config import AdamWConfig, CheckpointPolicy, TelemetryConfig, TrainConfig
    from marin.training.trainer import IncompatibleCheckpoint, run_training

    def config(name: str, order: str = WITHOUT_REPLACEMENT_V1) -> TrainConfig:
        return TrainConfig(output_path=str(tmp_path / name),
                           data=MixtureConfig(stores=(mini_store,), seed=3, order=order),
                           model=get_preset("tiny", n_layers=1, vocab_size=1024),  # the store's tokenizer
                           preset="tiny", pool="local-cpu-1", train_steps=4, tokens_per_step=256,
                           seq_len_phases=((0.0, 16), (0.5, 32)), optimizer=AdamWConfig(warmup_steps=1),
                           checkpoint=CheckpointPolicy(every_steps=2, every_minutes=None),
                           telemetry=TelemetryConfig(wandb_project=None, progress_every_s=0.0))

    read: list[tuple[int, np.ndarray]] = []  # (step, tokens) of every batch the trainer asks for
    real_batch = MixtureLoader.batch

    def recording_batch(self, step, batch_size, seq_len, rows=None):
        out = real_batch(self, step, batch_size, seq_len, rows)
        read.append((step, out["tokens"]))
        return out

    monkeypatch.setattr(MixtureLoader, "batch", recording_batch)
    clean = config("clean")
    run_training(clean, use_ray=False)
    uninterrupted = dict(read)
    assert sorted(uninterrupted) == [0, 1, 2, 3] and uninterrupted[3].shape == (8, 33)

    stopped = config("stopped")
    stop_after_checkpoint(stopped, 2)
    read.clear()
    assert run_training(stopped, use_ray=False)["resumed_from"] == 2
    assert [s for s, _ in read] == [2, 3]
    for step, tokens in read:
        np.testing.assert_array_equal(tokens, uninterrupted[step])
    a, meta = read_checkpoint(f"{clean.output_path}/checkpoints/step-00000004")
    b, _ = read_checkpoint(f"{stopped.output_path}/checkpoints/step-00000004")
    assert a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)
    assert meta["data_order"] == WITHOUT_REPLACEMENT_V1

    with pytest.raises(IncompatibleCheckpoint, match="data order 'without_replacement_v1'"):
        run_training(config("stopped", order=WITH_REPLACEMENT), use_ray=False)
