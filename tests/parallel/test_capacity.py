"""One formula per number: EP buffer capacities and phase-averaged FLOPs, each pinned to a slow,
obvious computation, and each called by every place that needs the number."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from marin.models.config import flops_per_token, get_preset, mean_flops_per_token
from marin.parallel.capacity import buffer_rows_per_token, recv_capacity, send_capacity
from marin.runsteps import phase_start_step, phase_steps
from marin.training.planning import expert_rows_per_token
from marin.training.schedule import SeqLenPhase, SeqLenSchedule, seq_len_at


def _balanced_counts(t: int, k: int, n_experts: int, ep: int) -> tuple[int, int]:
    """Route t tokens x k experts round-robin (the perfectly balanced wave the capacity is sized for)
    and count, one assignment at a time, the largest block a sender sends one device and the largest
    count one expert receives from all ``ep`` senders."""
    per_device, per_expert = Counter(), Counter()
    for token in range(t):
        for j in range(k):
            expert = (token * k + j) % n_experts
            per_device[expert // (n_experts // ep)] += 1
            per_expert[expert] += ep  # every sender routes the same way
    return max(per_device.values()), max(per_expert.values())


@pytest.mark.parametrize("t,k,n_experts,ep,cf", [(64, 2, 8, 4, 1.15), (128, 8, 384, 64, 1.15), (96, 8, 384, 64, 1.0),
                                                 (10, 2, 8, 8, 2.0), (7, 3, 12, 4, 1.25)])
def test_capacities_are_the_capacity_factor_times_the_expected_wave(t, k, n_experts, ep, cf):
    device, expert = _balanced_counts(t, k, n_experts, ep)
    worst_send = t * min(k, n_experts // ep)  # a sender can route every token's assignments to one device
    assert send_capacity(t, k, n_experts, ep, cf) == min(worst_send, math.ceil(cf * t * k / ep))
    assert send_capacity(t, k, n_experts, ep, None) == worst_send
    assert recv_capacity(t, k, n_experts, ep, None) == ep * t
    if t * k % n_experts == 0:  # the balanced wave fills every slot exactly once
        assert device == t * k / ep and expert == ep * t * k / n_experts
        assert send_capacity(t, k, n_experts, ep, cf) == min(worst_send, math.ceil(cf * device))
        assert recv_capacity(t, k, n_experts, ep, cf) == min(ep * t, math.ceil(cf * expert))


@pytest.mark.parametrize("transport", ["local", "fixed", "dropless", "ragged"])
def test_the_planner_counts_the_transports_own_buffers(transport):
    cfg = get_preset("hero")
    t, ep = 4096 * 16 // 64, 64
    rows = expert_rows_per_token(cfg, transport, ep, t)
    assert rows == buffer_rows_per_token(transport, t, cfg.top_k, cfg.n_experts, ep, cfg.capacity_factor)
    if transport == "fixed":
        e_loc = cfg.n_experts // ep
        assert rows["send"] == ep * send_capacity(t, cfg.top_k, cfg.n_experts, ep, 1.15) / t
        assert rows["compute"] == e_loc * recv_capacity(t, cfg.top_k, cfg.n_experts, ep, 1.15) / t
    with pytest.raises(ValueError, match="unknown transport 'carrier-pigeon'"):
        buffer_rows_per_token("carrier-pigeon", t, 8, 384, 64, 1.15)


HERO_PHASES = ((0.0, 4096), (0.5, 8192), (0.95, 65536))


@pytest.mark.parametrize("steps", [20, 39, 1000, 390_139])
def test_phase_averaged_flops_are_the_step_by_step_sum(steps):
    """The trainer's own schedule, step by step (slow and obvious), against the one formula."""
    cfg = get_preset("d768")
    sched = SeqLenSchedule(4096 * 64, tuple(SeqLenPhase(f, n) for f, n in HERO_PHASES))
    by_len = Counter(seq_len_at(s, steps, sched)[0] for s in range(steps)) if steps < 10_000 else None
    if by_len is None:  # the hero's horizon: count each phase's steps from its first step instead
        starts = [phase_start_step(f, steps) for f, _ in HERO_PHASES] + [steps]
        by_len = Counter({n: b - a for (a, b), (_, n) in zip(zip(starts, starts[1:]), HERO_PHASES)})
    assert dict(by_len) == {n: s for s, n in phase_steps(steps, HERO_PHASES) if s}
    slow = sum(count * flops_per_token(cfg, n) for n, count in by_len.items()) / steps
    assert mean_flops_per_token(cfg, HERO_PHASES, steps) == pytest.approx(slow, rel=1e-12)


def test_without_a_step_count_the_fractions_weigh_the_phases():
    cfg = get_preset("d768")
    by_fraction = 0.5 * flops_per_token(cfg, 4096) + 0.45 * flops_per_token(cfg, 8192) + 0.05 * flops_per_token(
        cfg, 65536)
    assert mean_flops_per_token(cfg, HERO_PHASES) == pytest.approx(by_fraction, rel=1e-12)
    # a long run converges to it: the rounding moves each boundary by less than one step
    assert mean_flops_per_token(cfg, HERO_PHASES, 390_139) == pytest.approx(by_fraction, rel=1e-5)
