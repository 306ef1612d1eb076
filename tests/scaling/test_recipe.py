"""The ladder recipe: rungs keep the target's ratios and reproduce the published ladder."""

from __future__ import annotations

import dataclasses

import pytest

from marin.models.config import PRESETS, count_params, flops_per_token, get_preset
from marin.scaling.recipe import (
    RecipeError,
    RunShape,
    format_ladder,
    ladder_rungs,
    phase_steps,
    run_flops,
    rung_model,
)

HERO = get_preset("hero")
HERO_PHASES = ((0.0, 4096), (0.5, 8192), (0.95, 65536))


def test_rungs_keep_the_heros_ratios():
    for d, layers in [(768, 8), (2048, 22), (3072, 28), (4096, 36)]:
        m = rung_model(HERO, d, layers)
        assert (m.d_model, m.n_layers, m.head_dim) == (d, layers, 128)
        assert m.latent_dim == m.expert_width == m.shared_width == d // 2  # latent = expert width = d/2
        assert (m.n_experts, m.top_k, m.n_shared_experts) == (384, 8, 2)
        assert (m.sliding_window, m.global_every, m.z_loss_weight) == (HERO.sliding_window, 4, HERO.z_loss_weight)
        assert m.n_heads == d // 128 and m.n_heads % m.n_kv_heads == 0
        # the presets of the published ladder are this recipe (up to performance-only settings: the
        # remat policy, and the expert width padding a run sets for its pool's mesh)
        preset = PRESETS[f"d{d}"]
        assert dataclasses.replace(m, remat_policy=preset.remat_policy,
                                   expert_width_multiple=preset.expert_width_multiple) == preset
    assert rung_model(HERO, 6144, 48) == HERO


def test_recipe_refuses_widths_that_break_a_ratio():
    with pytest.raises(RecipeError, match="not a multiple of the head size 128"):
        rung_model(HERO, 1000, 8)
    tiny = get_preset("tiny")  # d 64, head 16, latent 32
    with pytest.raises(RecipeError, match="latent_dim .* is not an integer"):
        rung_model(tiny.replace(latent_dim=30), 48, 2)
    with pytest.raises(RecipeError, match="no depth given"):
        ladder_rungs(
            HERO, [768], shape=RunShape(((0.0, 4096),), 0.01), depths={}, batch_sequences=1, budgets={768: 1e19}
        )
    with pytest.raises(RecipeError, match="no compute budget"):
        ladder_rungs(HERO, [768], shape=RunShape(((0.0, 4096),), 0.01), depths={768: 8}, batch_sequences=1)


def test_published_ladder_numbers():
    """d768: 61M active / 1.6B total / 5.5e19 FLOPs; d2048: 1.2B / 27.7B / 9.2e21 (published, rounded)."""
    from experiments.ladder import HERO_FLOPS, RUNGS

    by = {r.name: r for r in RUNGS}
    for name, active, total, flops in [("d768", 61e6, 1.6e9, 5.5e19), ("d2048", 1.2e9, 27.7e9, 9.2e21)]:
        r = by[name]
        assert r.budget_published
        assert r.active_params == pytest.approx(active, rel=0.05)
        assert r.total_params == pytest.approx(total, rel=0.02)
        assert r.flops == pytest.approx(flops, rel=0.001)  # the budget, up to rounding the step count
    assert by["d768"].tokens_per_step == 1_024 * 4096 and by["d2048"].tokens_per_step == 11_264 * 4096
    assert not by["d3072"].budget_published and not by["d4096"].budget_published
    assert HERO_FLOPS == pytest.approx(2.7e24, rel=0.03)  # "about 2.7e24"
    assert sum(r.flops for r in RUNGS) / HERO_FLOPS == pytest.approx(0.01, rel=0.05)  # "about 1%"
    table = format_ladder(RUNGS, HERO_FLOPS)
    assert "1.00% of the hero's" in table and "(budget assumed)" in table


def test_run_flops_is_phase_weighted():
    """Reference: step by step, tokens x FLOPs per token at the step's sequence length."""
    from marin.training.schedule import SeqLenPhase, SeqLenSchedule, seq_len_at

    m = get_preset("d768")
    steps, tps = 41, 8 * 65536
    sched = SeqLenSchedule(tps, tuple(SeqLenPhase(f, n) for f, n in HERO_PHASES))
    slow = sum(tps * flops_per_token(m, seq_len_at(s, steps, sched)[0]) for s in range(steps))
    assert run_flops(m, steps, tps, HERO_PHASES) == pytest.approx(slow, rel=1e-12)
    assert sum(n for n, _ in phase_steps(steps, HERO_PHASES)) == steps


def test_budget_from_tokens_per_param_and_schedule_shape():
    shape = RunShape.of_run(HERO_PHASES, 2_000, 390_139)
    [r] = ladder_rungs(HERO, [1024], shape=shape, depths={1024: 10}, batch_sequences=256, tokens_per_active_param=800)
    assert r.tokens / r.active_params == pytest.approx(800, rel=0.01)
    assert r.warmup_steps == round(2_000 / 390_139 * r.train_steps)
    assert r.shape.seq_len_phases == HERO_PHASES and r.tokens_per_step == 256 * 4096
    over = {f.name: getattr(r.model, f.name) for f in dataclasses.fields(r.model)
            if getattr(r.model, f.name) != getattr(HERO, f.name)}
    assert set(over) == {"d_model", "n_layers", "n_heads", "n_kv_heads", "n_kv_heads_global", "latent_dim",
                         "expert_width", "shared_width"}
    assert count_params(HERO.replace(**over)) == count_params(r.model)
