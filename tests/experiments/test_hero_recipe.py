"""The hero's published recipe in experiments/hero.py: pretraining then mid-training (the published
15T + 3.75T split as the last 20% of the run), MuonH at upstream's learning rates with AdamW as a
variant step, and `marin plan hero` showing both."""

from __future__ import annotations

import json
import math

import pytest

from marin.cli import main
from marin.commands import plan as plan_command
from marin.data import hero_mixture
from marin.execution.step import VersionedValue
from marin.training.optimizers import AdamWConfig, MuonHConfig
from marin.training.optimizers.muonh import heuristic_hyperparameters

pytestmark = pytest.mark.usefixtures("offline_k40")  # the experiment files, planned without their data


def _plain(x):
    return x.value if isinstance(x, VersionedValue) else x


def test_the_hero_trains_with_muonh_at_upstreams_learning_rates_and_adamw_is_a_variant():
    from experiments import hero

    main_opt, variant = hero.HERO_TRAIN["optimizer"], hero.hero_adamw.config.optimizer
    assert isinstance(main_opt, MuonHConfig) and isinstance(hero.hero.config.optimizer, MuonHConfig)
    rule = heuristic_hyperparameters(hero.HERO_STEPS * hero.HERO_TOKENS_PER_STEP, 6_144, hero.HERO_TOKENS_PER_STEP)
    assert (main_opt.peak_lr, main_opt.adam_lr, main_opt.beta2) == (rule["peak_lr"], rule["adam_lr"], rule["beta2"])
    assert isinstance(variant, AdamWConfig) and _plain(variant.peak_lr) == plan_command.HERO_ADAMW_PEAK_LR
    assert hero.hero_adamw.name == plan_command.HERO_ADAMW_STEP
    assert main_opt.warmup_steps == plan_command.HERO_WARMUP_STEPS and plan_command.HERO_OPTIMIZER_KIND == "muonh"
    # the early-cooldown branch continues the main run's optimizer (its state is MuonH's)
    assert isinstance(hero.hero_early_cooldown.config.optimizer, MuonHConfig)
    from marin.execution import plan_steps

    planned = plan_steps([hero.hero, hero.hero_adamw], "/p")
    assert planned.planned(hero.hero).hash != planned.planned(hero.hero_adamw).hash


def test_mid_training_is_the_last_fifth_of_the_heros_tokens_and_the_ladder_keeps_pretraining():
    from experiments import hero, ladder

    stages = _plain(hero.hero.config.data.stages)
    assert stages == hero_mixture.hero_stages(midtraining=True)
    mid = stages[-1]
    assert mid.domain_weights is None  # the domain shares stay
    # the published split: 15T pretraining + 3.75T mid-training
    assert hero_mixture.MIDTRAINING_FRACTION == pytest.approx(3.75 / 18.75)
    first_mid = mid.resolved_start(hero.HERO_STEPS)
    assert first_mid == math.ceil(0.8 * hero.HERO_STEPS) == 312_112
    # mid-training steps over the run's: 20% to within the one step the ceiling moves the start
    assert abs((hero.HERO_STEPS - first_mid) / hero.HERO_STEPS - 0.2) <= 1 / hero.HERO_STEPS
    # the top two buckets weighted up over the quality-weighted stage, the others as they were
    before = stages[0].quality_weights
    assert {b for b in before if mid.quality_weights[b] > before[b]} == {"q4", "q5"}
    assert all(mid.quality_weights[b] == before[b] for b in ("q1", "q2", "q3"))
    # the ladder's rungs: the two pretraining stages only
    rung = ladder.ladder_steps()[0]
    assert rung.name.startswith("ladder/d")
    assert _plain(rung.config.data.stages) == hero_mixture.hero_stages(midtraining=False)


def test_marin_plan_hero_shows_the_optimizer_and_the_mixture_stages(capsys):
    assert main(["plan", "hero", "--pool", "gb200-11racks", "--optimizer", "muonh"]) == 0
    out = capsys.readouterr().out
    assert "recipe (experiments/hero.py):\n  optimizer: muonh, upstream's learning rates" in out
    assert "MuonH 3.05e-03, Adam 7.04e-04, beta2 0.95" in out and "the memory above is sized" not in out
    assert "from step 117,042 (30%, 9.00T tokens): pretraining, quality-weighted" in out
    assert "from step 312,112 (80%, 3.60T tokens): mid-training (published: the last 20%, 15T + 3.75T)" in out
    assert main(["plan", "hero", "--pool", "gb200-11racks", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["recipe"]["optimizer"] == "muonh" and len(p["recipe"]["mixture_stages"]) == 3
    assert p["optimizer"] == "muonh"  # by default the memory is the main run's: sized for its optimizer
    assert main(["plan", "hero", "--pool", "gb200-11racks", "--optimizer", "adamw"]) == 0  # the AdamW variant's
    assert "(the memory above is sized for --optimizer adamw; --optimizer muonh sizes the main run's)" in (
        capsys.readouterr().out)
    assert main(["plan", "hero", "--pool", "gb200-11racks", "--seq-len", "8192", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recipe"] is None  # one phase pinned: not the whole run
