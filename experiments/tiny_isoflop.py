"""IsoFLOP on a laptop: for each of three compute budgets, four model sizes; the compute-optimal size
per budget; a loss surface L(N, D); then a validation run built from the fit and checked against it.

    python experiments/tiny_isoflop.py --prefix ./local_store

The steps, all cached:

1. the tiny ladder's data (a K40-shaped miniature corpus, a 512-entry BPE, tokens, the K40 mixture
   shape: uniform, then quality-weighted from 30% of every run) and a multiple-choice task (continue
   a passage in its own domain's language, :func:`experiments.defaults.default_domain_task`);
2. a grid of runs (``GRID``): per budget C, four or five widths of the tiny ladder's target (the recipe keeps
   the target's ratios; depth is the recipe's rule ``DEPTH``), each trained for as many steps as C
   buys at the batch of 4,096 tokens; each run is evaluated on the held-out split of the 40 domains
   (macro bpb) and on the task (accuracy and the correct answer's bits per byte);
3. ``tiny-isoflop/fit`` (:func:`experiments.defaults.default_isoflop_fit`): a parabola in log N per
   budget and its minimum N_opt(C), the power laws N_opt = k C^a and D_opt = k' C^b, the loss surface
   and its exponent beta / (alpha + beta), the law chosen for predictions, task-accuracy fits;
   ``isoflop.json`` and plots;
4. the validation run: :func:`marin.scaling.isoflop.predict_optimal_config` turns the fit into the
   compute-optimal rung at ``VALIDATION_BUDGET`` (2x the largest budget); it is trained, evaluated
   and compared with the prediction by ``tiny-isoflop/check`` (the same fit, plus ``validation``).

Because the validation run's config comes from the fit's result, the script plans twice: the grid
and the fit first, then, once ``isoflop.json`` exists, everything with the validation run and the
check (the second plan finds the first's steps cached). Timing and the prediction's error are in
docs/scaling.md.
"""

from __future__ import annotations

import json
import sys

from experiments.defaults import (
    default_domain_task,
    default_eval,
    default_isoflop_fit,
    default_k40_miniature,
    default_mixture,
    default_tokenize,
    default_tokenizer,
)
from experiments.tiny_ladder import QUALITY_WEIGHTS, STAGE2_FRACTION, TARGET, train_rung
from marin.data.mixture import MixtureStage
from marin.execution import executor_main
from marin.execution.main import parse_executor_args
from marin.scaling.isoflop import RecipeSpace, predict_optimal_config, surface_from_json
from marin.scaling.recipe import Rung, RunShape, ladder_rungs

# One sequence length: a phase switch is one more compilation per run, most of a small run's cost.
SHAPE = RunShape(seq_len_phases=((0.0, 64),), warmup_fraction=0.05)
BATCH_SEQUENCES = 64  # x 64 tokens = 4,096 tokens per step
GRID: dict[float, tuple[int, ...]] = {
    # budget (training FLOPs) -> widths; each budget's window sits around where the optimum is expected
    # d8 added after the first run of the grid put this budget's optimum below d16 (outside the sizes)
    1e11: (8, 16, 24, 32, 48),
    2.5e11: (16, 24, 32, 48),
    6e11: (24, 32, 48, 64),
}
VALIDATION_BUDGET = 1.2e12
WIDTHS_ALLOWED = tuple(range(8, 129, 8))
"""Widths the recipe may choose for the validation run (multiples of the 8-wide heads)."""
TASK_DOMAINS = ("council", "infra", "web_code", "science", "law", "medicine", "finance", "news")
CORPUS_BYTES = 40_000_000
P = "tiny-isoflop"


def DEPTH(d_model: int) -> int:
    """The recipe's depth rule at this scale: two layers at every width (as the tiny ladder)."""
    return 2


def budget_name(budget: float) -> str:
    """A budget as a step-name part: 2.5e11 -> "c2.5e11"."""
    mant, exp = f"{budget:.2g}".split("e")
    return f"c{mant}e{int(exp)}"


def data():
    corpus = default_k40_miniature(f"{P}/k40-mini", total_bytes=CORPUS_BYTES, seed=0)
    tokenizer = default_tokenizer(f"{P}/tokenizer", corpus, vocab_size=512, max_bytes=4_000_000)
    tokenized = default_tokenize(f"{P}/tokenized", corpus, tokenizer)
    mixture = default_mixture(
        [tokenized], stages=(MixtureStage(start_fraction=STAGE2_FRACTION, quality_weights=QUALITY_WEIGHTS),))
    task = default_domain_task(f"{P}/task", TASK_DOMAINS, questions_per_domain=16, n_choices=4, seed=0)
    return mixture, task


def train_and_eval(rung: Rung, mixture, task, budget: float):
    train = train_rung(f"{P}/{rung.name}", rung, mixture, f"tiny isoflop {rung.name}: {rung.train_steps} steps, "
                                                         f"{rung.flops:.3g} FLOPs (budget {budget:.3g})")
    evaluation = default_eval(f"{P}/{rung.name}-eval", train, held_out=True, tasks={"k40_domains": task})
    return train, evaluation


def tiny_isoflop():
    """The grid, its evaluations and the fit: a dict of steps."""
    mixture, task = data()
    runs = []
    for budget, widths in GRID.items():
        for rung in ladder_rungs(TARGET, widths, shape=SHAPE, depths={d: DEPTH(d) for d in widths},
                                 batch_sequences=BATCH_SEQUENCES, budgets={d: budget for d in widths},
                                 name=f"{budget_name(budget)}-d{{d}}"):
            runs.append((budget, rung, *train_and_eval(rung, mixture, task, budget)))
    grid = [(budget, t, e) for budget, _, t, e in runs]
    fit = default_isoflop_fit(f"{P}/fit", grid, recipe=recipe(), next_budget=VALIDATION_BUDGET)
    return {"mixture": mixture, "task": task, "runs": runs, "grid": grid, "fit": fit}


def recipe():
    """What predict_optimal_config may choose from: the target, its shape, batch, widths and depth rule."""
    return RecipeSpace(target=TARGET, shape=SHAPE, batch_sequences=BATCH_SEQUENCES, widths=WIDTHS_ALLOWED,
                       depths=tuple((d, DEPTH(d)) for d in WIDTHS_ALLOWED))


def tiny_isoflop_validation(steps: dict, isoflop_doc: dict):
    """The validation run that the fit in ``isoflop_doc`` predicts (never fitted) and the check step."""
    best = predict_optimal_config(surface_from_json(isoflop_doc["surface"]), VALIDATION_BUDGET, recipe())
    rung = best.rung
    rung = Rung(f"val-{rung.name}", rung.model, rung.batch_sequences, rung.train_steps, rung.warmup_steps,
                rung.shape, rung.flops_budget)
    train, evaluation = train_and_eval(rung, steps["mixture"], steps["task"], VALIDATION_BUDGET)
    check = default_isoflop_fit(f"{P}/check", steps["grid"], recipe=recipe(), next_budget=VALIDATION_BUDGET,
                                validation=(VALIDATION_BUDGET, train, evaluation))
    return {"optimal": best, "train": train, "eval": evaluation, "check": check}


if __name__ == "__main__":
    # Two plans, both from this one command line: the validation run's config is the fit's result.
    config = parse_executor_args(sys.argv[1:])
    steps = tiny_isoflop()
    first = executor_main(config, steps=[steps["fit"]], description="tiny IsoFLOP: grid -> fit")
    if config.dry_run:
        print("dry run: the validation run is planned once the fit has run")
        raise SystemExit(0)
    with open(f"{first.plan.planned(steps['fit']).output_path}/isoflop.json") as f:
        doc = json.load(f)
    val = tiny_isoflop_validation(steps, doc)
    print(f"validation run: {val['optimal'].describe()}")
    executor_main(config, steps=[steps["fit"], val["check"]],
                  description="tiny IsoFLOP: grid -> fit -> compute-optimal validation run -> check")
