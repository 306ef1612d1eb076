"""The production experiment files plan offline and match the published run's numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

from marin.execution import plan_steps, resolve_config
from marin.review.experiment_file import load_experiment

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("offline_k40")  # the experiment files, planned without their data


def _train_configs(name: str, prefix: str):
    steps, _ = load_experiment(str(REPO / "experiments" / f"{name}.py"))
    plan = plan_steps(steps, prefix)
    return plan, {s.name: resolve_config(s, plan) for s in plan.steps if s.step.fn.__name__ == "train"}


def test_hero_matches_the_published_run(tmp_path):
    plan, trains = _train_configs("hero", str(tmp_path))
    [(name, cfg)] = trains.items()
    assert cfg.preset == "hero" and cfg.model.n_layers == 48 and cfg.pool.name == "gb200-11racks"
    assert cfg.train_steps == 390_139 and cfg.tokens_per_step == 11_264 * 4096 == 46_137_344
    assert round(cfg.train_steps * cfg.tokens_per_step / 1e12, 1) == 18.0  # steps x batch, not 18.75T
    assert [s for _, s in cfg.seq_len_phases] == [4096, 8192, 65536, 262144]
    assert cfg.parallelism.context_parallel_by_seq_len == ((262144, 4),)  # 176 sequences of 262K over 704 devices
    assert cfg.parallelism.transport_switches == ((0, "fixed"), (81_716, "ragged_capacity"))
    assert len(cfg.data.stores) == 40  # one token store per K40 domain

    # stage 2 at 30% of the run: step 117,042 of the hero's 390,139; mid-training for the last 20%
    # (the published 15T + 3.75T split) from step 312,112
    stage, midtraining = cfg.data.stages
    assert stage.resolved_start(cfg.train_steps) == 117_042 and midtraining.resolved_start(cfg.train_steps) == 312_112
    # tokenizer, dedup, decontamination and the task it protects, 40 tokenize steps, train, health
    assert len(plan.steps) == 1 + 3 + 40 + 1 + 1
    names = [s.name for s in plan.steps]
    assert {"data/harrier_k40/dedup", "data/harrier_k40/decontaminate", "tiny-isoflop/task"} <= set(names)


def test_ladder_rungs_spend_their_published_budgets(tmp_path):
    from experiments.ladder import RUNGS
    from marin.scaling.recipe import run_flops

    _, trains = _train_configs("ladder", str(tmp_path))
    assert sorted(trains) == sorted(f"ladder/{r.name}" for r in RUNGS)
    for rung in RUNGS:
        cfg = trains[f"ladder/{rung.name}"]
        model = cfg.model  # resolved when the step was declared (max_seq_len raised to the longest phase)
        assert model.replace(max_seq_len=rung.model.max_seq_len) == rung.model and model.d_model == int(rung.name[1:])
        spent = run_flops(model, cfg.train_steps, cfg.tokens_per_step, cfg.seq_len_phases)
        assert spent == pytest.approx(rung.flops_budget, rel=0.01)
        # the hero's schedule shape
        assert cfg.seq_len_phases == ((0.0, 4096), (0.5, 8192), (0.95, 65536), (0.99, 262144))
        # the quality-weighted stage starts at 30% of every rung, not at the hero's step 117,042
        [stage] = cfg.data.stages
        assert stage.start_fraction == 0.3 and stage.start_step is None
    assert trains["ladder/d768"].pool.name == "gb200-rack" and trains["ladder/d768"].tokens_per_step == 1024 * 4096
    # the 11-rack rungs store their experts padded to a multiple of 11 (fsdp splits them over the racks)
    assert {n: c.model.stored_expert_width for n, c in trains.items()} == {
        "ladder/d768": 384, "ladder/d2048": 1034, "ladder/d3072": 1540, "ladder/d4096": 2057}


def test_changing_only_the_mixture_keeps_the_token_stores(tmp_path):
    """Mixtures change without re-tokenizing: the hero and the ladder share all 41 data steps."""
    hero_plan, _ = _train_configs("hero", str(tmp_path))
    ladder_plan, _ = _train_configs("ladder", str(tmp_path))
    data = lambda plan: {s.output_path for s in plan.steps if s.name.startswith(("tokenized/", "tokenizers/"))}  # noqa: E731
    assert len(data(hero_plan)) == 41 and data(hero_plan) == data(ladder_plan)
