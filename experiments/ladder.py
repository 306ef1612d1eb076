"""The scaling ladder: small MoE rungs trained with the hero recipe before the hero (about 1% of its
compute), to catch bugs and fit scaling laws of loss, grad norm and drop fraction.

    python experiments/ladder.py --dry_run true                         # plan; no network needed
    marin run experiments/ladder.py --address ray://head:10001 --prefix s3://bucket/marin

Original script name: experiments/grug/moe_hero_ep/launch_scaling_ladder.py. The rungs come from
``marin.scaling.recipe.ladder_rungs``: the hero's ratios (head size, GQA, latent = expert width =
shared width = d/2, 384 experts top-8 + 2 shared, attention pattern) at each width, and the hero's
schedule shape (4K -> 8K at 50% -> 65K at 95%, warmup and stage-2 mixture at the same fractions).
Published budgets: d768 on 1 rack at batch 1,024 x 4,096 for 5.5e19 FLOPs, d2048 on 11 racks at
11,264 x 4,096 for 9.2e21 FLOPs. d3072 and d4096 are not published: their budgets below are
assumptions (the remainder of ~1% of the hero's compute, split 1:2), which gives them far fewer
tokens per parameter than the published rungs (the printed table shows it). Depths are fitted to
the published total parameter counts (d3072/d4096 interpolated).
"""

from __future__ import annotations

import dataclasses

from experiments.defaults import (
    default_eval,
    default_health_report,
    default_ladder_fit,
    default_train,
)
from experiments.harrier_k40 import harrier_k40_mixture
from experiments.hero import (
    HERO_BATCH_SEQUENCES,
    HERO_CONTEXT_PARALLEL,
    HERO_SEQ_LEN_PHASES,
    HERO_STEPS,
    HERO_WARMUP_STEPS,
)
from marin.execution import executor_main
from marin.models.config import get_preset
from marin.pools import get_pool
from marin.scaling.recipe import (
    RunShape,
    format_ladder,
    ladder_rungs,
    run_flops,
)
from marin.training.config import AdamWConfig, CheckpointPolicy, ParallelismConfig, TelemetryConfig

SEQ_LEN = 4096
HERO = get_preset("hero")
HERO_SHAPE = RunShape.of_run(HERO_SEQ_LEN_PHASES, HERO_WARMUP_STEPS, HERO_STEPS)
HERO_FLOPS = run_flops(HERO, HERO_STEPS, HERO_BATCH_SEQUENCES * SEQ_LEN, HERO_SEQ_LEN_PHASES)

RUNG_POOL = {768: "gb200-rack", 2048: "gb200-11racks", 3072: "gb200-11racks", 4096: "gb200-11racks"}
"""The pool each rung trains on, by width (the pools themselves: marin.pools.POOLS)."""


def _padded_for(model, pool: str):
    """The rung with its routed experts' width padded to a multiple of the pool's data axis (the
    hero's 11 on 11 racks; none on one rack): fsdp can then split the experts over "data" too. An
    exact no-op on the model (docs/model.md), so the rung's parameters and FLOPs are unchanged."""
    return model.replace(expert_width_multiple=get_pool(pool).mesh[0])


RUNGS = ladder_rungs(
    HERO,
    (768, 2048, 3072, 4096),
    shape=HERO_SHAPE,
    depths={768: 8, 2048: 22, 3072: 28, 4096: 36},
    batch_sequences={768: 1_024, 2048: 11_264, 3072: 11_264, 4096: 11_264},
    budgets={768: 5.5e19, 2048: 9.2e21, 3072: 5.9e21, 4096: 1.18e22},
    published=(768, 2048),
)
RUNGS = [dataclasses.replace(r, model=_padded_for(r.model, RUNG_POOL[r.model.d_model])) for r in RUNGS]


def ladder_steps():
    """Per rung: train, evaluate (bpb on the mixture's held-out split), health; then the fit that
    predicts the hero (``fit.json``: what ``marin health --fit`` judges the hero by)."""
    from experiments.hero import hero

    mixture = harrier_k40_mixture()
    out, rungs = [], []
    for rung in RUNGS:
        train = default_train(
            f"ladder/{rung.name}",
            mixture=mixture,
            model=rung.model.replace(dtype="bfloat16"),  # bf16 compute, float32 master weights, as the hero
            preset="hero",
            pool=RUNG_POOL[rung.model.d_model],
            train_steps=rung.train_steps,
            tokens_per_step=rung.tokens_per_step,
            seq_len_phases=rung.shape.seq_len_phases,
            optimizer=AdamWConfig(peak_lr=3e-4, warmup_steps=rung.warmup_steps),
            checkpoint=CheckpointPolicy(every_steps=1000, keep_every=10_000),
            telemetry=TelemetryConfig(wandb_project="marin-ladder"),
            parallelism=ParallelismConfig(
                transport_switches=((0, "fixed"),),
                param_sharding="fsdp",  # weights, gradients and AdamW state split over the mesh, as the hero
                remat_by_seq_len=((65536, "full"), (262144, "full")),  # as the hero: its long phases recompute
                context_parallel_by_seq_len=HERO_CONTEXT_PARALLEL,  # as the hero: 262K sequences over 4 devices
            ),
            # every phase of every rung fits its pool (`marin plan`): the default memory check refuses
            # a change that breaks that when the file is read
            description=f"ladder rung {rung.name}: {rung.train_steps:,} steps, {rung.flops:.2g} FLOPs"
            + ("" if rung.budget_published else " (budget assumed)"),
        )
        evaluation = default_eval(f"ladder/{rung.name}-eval", train, held_out=True)
        rungs.append((train, evaluation))
        out += [
            train,
            evaluation,
            default_health_report(f"ladder/{rung.name}-health", train, total_steps=rung.train_steps),
        ]
    return [*out, default_ladder_fit("ladder/fit", rungs, target=hero)]


if __name__ == "__main__":
    print(format_ladder(RUNGS, HERO_FLOPS))
    executor_main(steps=ladder_steps(), description="MoE scaling ladder (hero recipe, ~1% of hero compute)")
