"""A scaling ladder you can run on a laptop: train rungs, fit, predict a larger rung, check it.

    python experiments/tiny_ladder.py --prefix ./local_store            # the full ladder
    TINY_LADDER=reduced python experiments/tiny_ladder.py --prefix ...  # a smaller one, no eval steps

The same loop as the production ladder (experiments/ladder.py), at toy scale, all as cached steps:

1. a K40-shaped miniature corpus large enough that no rung repeats data, a BPE tokenizer, tokens,
   and the K40 mixture shape: uniform within domains, quality-weighted from 30% of every run;
2. rungs from ``marin.scaling.recipe.ladder_rungs``: a tiny MoE target (8 experts top-2, one
   shared expert, latent = expert width = d/2, 8-wide heads with 2:1 GQA, one global attention
   layer in four) at widths 32..80 and 2 layers, each trained for the same tokens per active parameter (so compute grows
   about 21x over the rungs), with the target's schedule shape (warmup 5%, 64 -> 128 tokens per
   sequence at 50%, LR decay to 5% of peak); the rungs are independent steps, so Ray runs them side by side;
   each rung is evaluated (bits per byte on the mixture's held-out split of all 40 domains);
3. a fit step (``fit.json``, plots): final loss and macro bpb vs compute, the same fit at 3/10/30/50/100% of each
   run (the predicted trajectory of the target), grad-norm shape and drop fractions over scale,
   leave-one-out;
4. a validation rung (width 96, about twice the largest rung's compute) the fit never sees, and a
   check step that compares it with the prediction and records ``validation_rel_error``.

Read the result with ``marin show tiny-ladder/check`` or open ``fit.json`` and the PNGs in the
check step's directory (docs/scaling.md explains them). Timing on this machine is in
docs/performance.md.
"""

from __future__ import annotations

import os

from experiments.defaults import (
    default_eval,
    default_k40_miniature,
    default_ladder_fit,
    default_mixture,
    default_mixture_report,
    default_tokenize,
    default_tokenizer,
    default_train,
)
from marin.data.mixture import MixtureStage
from marin.execution import executor_main
from marin.models.config import get_preset
from marin.scaling.recipe import Rung, RunShape, ladder_rungs
from marin.training.config import AdamWConfig, CheckpointPolicy, TelemetryConfig

# The K40 stage-2 quality weights and start (as a fraction of each run), as in the hero's mixture.
QUALITY_WEIGHTS = {"q1": 0.25, "q2": 0.5, "q3": 1.0, "q4": 2.0, "q5": 4.0}
STAGE2_FRACTION = 0.3

# The target the rungs scale: the "tiny" preset as an 8-expert top-2 MoE with one shared expert and
# 8-wide heads (so every rung width here has an even head count and keeps the 2:1 GQA ratio).
TARGET = get_preset("tiny", n_experts=8, top_k=2, transport="local", max_seq_len=128, head_dim=8, n_heads=8,
                    n_kv_heads=4)
SHAPE = RunShape(seq_len_phases=((0.0, 64), (0.5, 128)), warmup_fraction=0.05)
BATCH_SEQUENCES = 64  # x 64 tokens = 4,096 tokens per step
PEAK_LR = 5e-3

SIZES = {
    # name: rung widths, validation width, tokens per active parameter, corpus bytes, evaluate
    "full": ((32, 48, 64, 80), 96, 15.0, 16_000_000, True),
    # the default tests' smoke run: the same steps minus the eval steps (fits on training loss)
    "reduced": ((16, 32, 48), 64, 3.0, 2_000_000, False),
}
# The reduced ladder keeps one sequence length: a phase switch is one more compilation per rung,
# which is most of its cost.
REDUCED_SHAPE = RunShape(seq_len_phases=((0.0, 64),), warmup_fraction=0.05)


def train_rung(name: str, rung: Rung, mixture, description: str):
    """A tiny rung's training step (the tiny ladder's and the tiny IsoFLOP grid's): the rung's model,
    batch and schedule on one CPU, one checkpoint at the end, no W&B."""
    return default_train(
        name,
        mixture=mixture,
        model=rung.model,
        preset="tiny",
        pool="local-cpu-1",
        train_steps=rung.train_steps,
        tokens_per_step=rung.tokens_per_step,
        seq_len_phases=rung.shape.seq_len_phases,
        optimizer=AdamWConfig(peak_lr=PEAK_LR, warmup_steps=rung.warmup_steps),
        checkpoint=CheckpointPolicy(every_steps=rung.train_steps, every_minutes=None),
        telemetry=TelemetryConfig(wandb_project=None),
        description=description,
    )


def tiny_ladder(size: str = "full"):
    """The steps of the tiny ladder at ``size`` ("full" or "reduced"); returns a dict of them."""
    if size not in SIZES:
        raise ValueError(f"unknown tiny ladder size {size!r}; choose from {sorted(SIZES)}")
    widths, val_width, tokens_per_param, corpus_bytes, evaluate = SIZES[size]
    p = f"tiny-ladder/{size}" if size != "full" else "tiny-ladder"
    corpus = default_k40_miniature(f"{p}/k40-mini", total_bytes=corpus_bytes, seed=0)
    tokenizer = default_tokenizer(f"{p}/tokenizer", corpus, vocab_size=512, max_bytes=4_000_000)
    tokenized = default_tokenize(f"{p}/tokenized", corpus, tokenizer)
    mixture = default_mixture(
        [tokenized],
        stages=(MixtureStage(start_fraction=STAGE2_FRACTION, quality_weights=QUALITY_WEIGHTS),),
    )
    all_widths = (*widths, val_width)
    rungs = ladder_rungs(
        TARGET,
        all_widths,
        shape=SHAPE if size == "full" else REDUCED_SHAPE,
        depths={d: 2 for d in all_widths},
        batch_sequences=BATCH_SEQUENCES,
        tokens_per_active_param=tokens_per_param,
    )
    trains, evals = {}, {}
    for rung in rungs:
        about = f"tiny ladder rung {rung.name}: {rung.train_steps} steps, {rung.flops:.3g} FLOPs"
        trains[rung.name] = train_rung(f"{p}/{rung.name}", rung, mixture, about)
        # bits per byte of the final checkpoint on the mixture's held-out split (40 domains: macro bpb)
        evals[rung.name] = default_eval(f"{p}/{rung.name}-eval", trains[rung.name], held_out=True) if evaluate else None
    val_name = f"d{val_width}"
    fitted = [(trains[r.name], evals[r.name]) for r in rungs if r.name != val_name]
    biggest = max(rungs, key=lambda r: r.tokens)  # the validation rung: no run may repeat data
    fit = default_ladder_fit(f"{p}/fit", fitted, target=trains[val_name])
    check = default_ladder_fit(
        f"{p}/check", fitted, target=trains[val_name], validation=(trains[val_name], evals[val_name])
    )
    report = default_mixture_report(f"{p}/mixture", mixture, total_tokens=biggest.tokens,
                                    total_steps=biggest.train_steps)
    return {"rungs": rungs, "trains": trains, "evals": evals, "fit": fit, "check": check, "mixture_report": report,
            "validation": val_name}


if __name__ == "__main__":
    import sys

    steps = tiny_ladder(os.environ.get("TINY_LADDER", "full"))
    argv = sys.argv[1:]
    if not any(a.startswith("--max_concurrent") for a in argv):
        # One step per core at a time: a rung's pool waits at most a few minutes for its CPU, so on a
        # small machine more rungs than cores at once would time out instead of queueing.
        argv += ["--max_concurrent", str(os.cpu_count() or 1)]
    executor_main(steps=[steps["mixture_report"], steps["fit"], steps["check"]], argv=argv,
                  description="tiny scaling ladder: rungs -> fit -> validation rung -> check",
                  hypothesis="Final loss and bits per byte of the tiny rungs follow a power law in training "
                             "FLOPs, so a fit to the smaller rungs predicts the largest (held-out) rung.",
                  goal="The validation rung's final loss within the check's tolerance of the prediction.",
                  risks="Too few rungs or too little compute per rung to separate the power law from noise; "
                        "repeated data in the largest rung.",
                  contingency="If the check fails, inspect the fit's leave-one-out error and the rungs' curves "
                              "(the report overlays them); add a rung or lengthen the runs before trusting "
                              "predictions at larger scale.")
