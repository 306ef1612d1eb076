"""Schedules against slow, obvious references."""

import pytest

from marin.training.schedule import (
    LRSchedule,
    SeqLenPhase,
    SeqLenSchedule,
    TransportSchedule,
    lr_at,
    seq_len_at,
    transport_at,
)


def reference_lr(peak, warmup, total, final_frac, replans, n_steps):
    """Walk the steps one at a time, keeping the current straight line explicitly."""
    out = []
    final = final_frac * peak
    # current line: (start_step, start_lr, end_step, end_lr)
    line = (warmup, peak, total, final)
    pending = list(replans)
    for step in range(n_steps):
        if pending and step == pending[0][0]:
            at, new_total = pending.pop(0)
            s0, l0, s1, l1 = line
            frac = min(1.0, (at - s0) / (s1 - s0)) if s1 > s0 else 1.0
            current = l0 + (l1 - l0) * frac
            line = (at, current, new_total, final)
        if step < warmup:
            out.append(peak * (step + 1) / warmup)
            continue
        s0, l0, s1, l1 = line
        frac = min(1.0, (step - s0) / (s1 - s0)) if s1 > s0 else 1.0
        out.append(l0 + (l1 - l0) * frac)
    return out


@pytest.mark.parametrize(
    "warmup,total,replans,n",
    [
        (10, 100, (), 120),
        (0, 50, (), 50),
        (5, 100, ((30, 60),), 80),  # shorten the horizon (the published contingency)
        (5, 100, ((30, 200),), 220),  # lengthen it
        (5, 100, ((20, 70), (40, 50)), 60),  # two re-plans
    ],
)
def test_lr_matches_reference(warmup, total, replans, n):
    sched = LRSchedule(peak_lr=3e-3, warmup_steps=warmup, total_steps=total)
    for at, new_total in replans:
        sched = sched.replanned(at, new_total)
    ref = reference_lr(3e-3, warmup, total, 0.05, replans, n)
    got = [lr_at(s, sched) for s in range(n)]
    assert got == pytest.approx(ref, rel=1e-12, abs=1e-15)


def test_lr_endpoints_and_continuity():
    sched = LRSchedule(peak_lr=1.0, warmup_steps=10, total_steps=100)
    assert lr_at(9, sched) == pytest.approx(1.0)
    assert lr_at(100, sched) == pytest.approx(0.05)
    assert lr_at(1000, sched) == pytest.approx(0.05)
    re = sched.replanned(40, 70)
    # identical before the switch, continuous at it, floor at the new end
    assert [lr_at(s, re) for s in range(41)] == [lr_at(s, sched) for s in range(41)]
    slope_before = lr_at(40, sched) - lr_at(39, sched)
    assert abs(lr_at(41, re) - lr_at(40, re)) < 2 * abs(slope_before) + 0.05
    assert lr_at(70, re) == pytest.approx(0.05)
    assert re.final_total_steps == 70


def test_lr_validation():
    with pytest.raises(ValueError):
        LRSchedule(peak_lr=1.0, warmup_steps=20, total_steps=10)
    with pytest.raises(ValueError, match="after warmup"):
        LRSchedule(peak_lr=1.0, warmup_steps=10, total_steps=100).replanned(5, 50)
    with pytest.raises(ValueError, match="after the switch"):
        LRSchedule(peak_lr=1.0, warmup_steps=10, total_steps=100).replanned(50, 50)


def test_seq_len_schedule_keeps_tokens_constant():
    # The hero's 4K -> 8K at 50% -> 65K at 95%, scaled down by 64.
    sched = SeqLenSchedule(4096, (SeqLenPhase(0.0, 64), SeqLenPhase(0.5, 128), SeqLenPhase(0.95, 1024)))
    total = 20
    got = [seq_len_at(s, total, sched) for s in range(total)]
    ref = []
    for s in range(total):
        L = 64 if s < 10 else (128 if s < 19 else 1024)
        ref.append((L, 4096 // L))
    assert got == ref
    assert all(L * B == 4096 for L, B in got)


def test_seq_len_validation():
    with pytest.raises(ValueError, match="multiple"):
        SeqLenSchedule(1000, (SeqLenPhase(0.0, 64),))
    with pytest.raises(ValueError, match=r"the first phase must start at 0 \(the run's first step\), got 0.1"):
        SeqLenSchedule(1024, (SeqLenPhase(0.1, 64),))
    with pytest.raises(ValueError, match=r"strictly increasing, got \[0.0, 0.6, 0.2\]"):
        SeqLenSchedule(1024, (SeqLenPhase(0.0, 64), SeqLenPhase(0.6, 64), SeqLenPhase(0.2, 128)))
    with pytest.raises(ValueError, match=r"a phase must start at a fraction of the run in \[0, 1\), got 1.5"):
        SeqLenSchedule(1024, (SeqLenPhase(0.0, 64), SeqLenPhase(1.5, 128)))


def test_transport_schedule():
    sched = TransportSchedule(((0, "fixed"), (81_716, "dropless")))
    assert transport_at(0, sched) == "fixed"
    assert transport_at(81_715, sched) == "fixed"
    assert transport_at(81_716, sched) == "dropless"
    assert transport_at(390_138, sched) == "dropless"
    with pytest.raises(ValueError):
        TransportSchedule(((5, "fixed"),))
