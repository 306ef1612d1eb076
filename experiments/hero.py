"""The hero run: 535B total / 23B active fine-grained MoE on Harrier K40 (the published Marin run).

    python experiments/hero.py --dry_run true                           # plan; no network needed
    marin run experiments/hero.py --address ray://head:10001 --prefix s3://bucket/marin

48 layers, d 6,144, 384 routed experts top-8 plus 2 shared, latent 3,072; 11 GB200 NVL72 racks with
EP 64 inside a rack and data parallelism 11; 390,139 steps of 11,264 x 4,096 = 46,137,344 tokens
(18.0T tokens: the published 18.75T does not match steps x batch, and this file follows steps x batch);
sequence length 4K -> 8K at 50% -> 65K at 95% -> 262K for the last 1% (an assumption: "near the
end"; each 262K sequence split over 4 devices by context parallelism); fixed-buffer all-to-all at
capacity 1.15, hot-switched at step 81,716 to the capacity-bounded ragged all-to-all the published run
continued on (one update per source device and local expert, the 6 local experts of a device in 2
chunks sharing a receiver capacity of 1.15 x the expected rows; it can drop, about 150 times less
than the fixed buffers). The data recipe as published: K40 at its domain shares, uniform within each
domain, quality-weighted from 30% (an assumption), and mid-training for the last 20% of the run (the
published 15T + 3.75T split; what it favours is not published: we assume the top two quality
buckets weighted up; marin.data.hero_mixture). The optimizer as upstream's hero: MuonH with the
learning rates of upstream's size rule (MuonH 3.05e-3, Adam 7.04e-4, beta2 0.95 at 18.0T tokens, d
6,144 and 46.1M tokens per step); the warmup is not published (an assumption). AdamW (peak 2.2e-4,
an assumption) is a variant step of its own: ``hero/moe-535b-a23b-adamw``.

The early-cooldown side branch (days 10-20 of the run, 1-2 days long, for RL and long-context
experiments) starts from a committed checkpoint of the main run and leaves the main run untouched:

    marin run experiments/hero.py --run_only 'hero/moe-535b-a23b-early-cooldown' ...   # once step 60,000 is committed

Contingencies are operator actions on the live run, not edits of versioned fields, so the output
path (and its checkpoints) stay: re-plan the horizon with ``lr_replans`` (the LR still ends at 5% of
peak; see marin replan-lr), switch transport with ``transport_switches``.
"""

from __future__ import annotations

import dataclasses
import os

from experiments.defaults import branch_from, default_health_report, default_train
from experiments.harrier_k40 import harrier_k40_mixture
from marin.execution import executor_main
from marin.models.config import get_preset
from marin.training.config import CheckpointPolicy, ParallelismConfig, TelemetryConfig
from marin.training.optimizers import AdamWConfig, MuonHConfig

HERO_STEPS = 390_139
HERO_BATCH_SEQUENCES = 11_264
HERO_TOKENS_PER_STEP = HERO_BATCH_SEQUENCES * 4096  # 46,137,344
# 4K -> 8K at 50% -> 65K at 95% -> 262K near the end. The 262K phase's start is not published ("near
# the end"): we assume the last 1% of the steps (from step 386,238: ~3,900 steps, ~180B tokens).
HERO_SEQ_LEN_PHASES = ((0.0, 4096), (0.5, 8192), (0.95, 65536), (0.99, 262144))
# 262,144 tokens x 176 sequences per step for 704 devices: each sequence is split over 4 devices of
# its rack's expert axis (context parallelism; `marin plan hero --pool gb200-11racks --seq-len 262144`)
HERO_CONTEXT_PARALLEL = ((262144, 4),)
HERO_WARMUP_STEPS = 2_000
FIXED_TO_RAGGED_STEP = 81_716
# the early-cooldown branch: at about day 14 (~4,400 steps/day), ~1.5 days of linear decay to the final LR
# the second checkpoint tier, as the published run has it: a rolling temporary checkpoint every hour to
# fast region-local storage (one kept). Where that is depends on the cluster, so it is read from the
# environment (e.g. s3://<region-local bucket>/marin-temp); unset, the run writes permanent checkpoints only
HERO_TEMP_CHECKPOINT_PATH = os.environ.get("HERO_TEMP_CHECKPOINT_PATH") or None
EARLY_COOLDOWN_AT_STEP = 60_000  # a multiple of checkpoint.keep_every, so the main run keeps that checkpoint
EARLY_COOLDOWN_STEPS = 6_600

# MuonH as upstream's hero trains (marin.training.optimizers.muonh): its learning rates and Adam beta2 from
# upstream's size rule at 18.0T tokens, d 6,144 and 46.1M tokens per step (MuonH 3.05e-3, Adam 7.04e-4,
# beta2 0.95), warmup HERO_WARMUP_STEPS and decay to 5% of peak
HERO_MUONH = MuonHConfig.from_heuristic(HERO_STEPS * HERO_TOKENS_PER_STEP, d_model=6_144,
                                        tokens_per_batch=HERO_TOKENS_PER_STEP, warmup_steps=HERO_WARMUP_STEPS)
HERO_OPTIMIZER = HERO_MUONH
HERO_ADAMW = AdamWConfig(peak_lr=2.2e-4, warmup_steps=HERO_WARMUP_STEPS)  # the variant; its peak LR is assumed
HERO_CHECKPOINT = CheckpointPolicy(
    every_steps=500,
    every_minutes=30.0,
    keep_every=10_000,
    temp_every_minutes=60.0 if HERO_TEMP_CHECKPOINT_PATH else None,
    temp_path=HERO_TEMP_CHECKPOINT_PATH,
)
HERO_TRAIN = dict(
    mixture=harrier_k40_mixture(midtraining=True),  # pretraining 80%, mid-training the last 20%
    model=get_preset("hero", dtype="bfloat16"),  # bf16 compute, float32 master weights
    preset="hero",
    pool="gb200-11racks",
    train_steps=HERO_STEPS,
    tokens_per_step=HERO_TOKENS_PER_STEP,
    seq_len_phases=HERO_SEQ_LEN_PHASES,
    optimizer=HERO_OPTIMIZER,
    checkpoint=HERO_CHECKPOINT,
    telemetry=TelemetryConfig(wandb_project="marin-hero"),
    parallelism=ParallelismConfig(
        # both transports bound their buffers by the model's capacity_factor (1.15); ragged_capacity pools it
        # over each chunk of a device's local experts (the model's expert_chunks: 2 chunks of 3)
        transport_switches=((0, "fixed"), (FIXED_TO_RAGGED_STEP, "ragged_capacity")),
        # weights, gradients and AdamW state split over the mesh (FSDP): dense weights 64 ways inside each
        # rack (11 divides none of their dimensions), routed experts 704 ways (the preset pads their
        # width to 3080 = 11 x 280)
        param_sharding="fsdp",
        # the 65K phase (one sequence per device) recomputes every layer: under the model's `dots`
        # policy its activations would not fit a GB200; nor would the 262K phase's
        remat_by_seq_len=((65536, "full"), (262144, "full")),
        context_parallel_by_seq_len=HERO_CONTEXT_PARALLEL,
    ),
    # every phase (each sequence length on each transport) fits a GB200: `marin plan hero --pool gb200-11racks`
    memory_check="error",
)
hero = default_train("hero/moe-535b-a23b", **HERO_TRAIN,
                     description="hero 535B-A23B on Harrier K40 with MuonH, 390,139 steps x 46.1M tokens, "
                                 "mid-training the last 20%")
# Same recipe and data stream, weights, AdamW state and step counter from the main run's checkpoint
# at EARLY_COOLDOWN_AT_STEP, resharded onto its pool; the horizon re-planned to end the decay
# EARLY_COOLDOWN_STEPS later (the LR still ends at 5% of peak). Its own output path: the main run
# is untouched.
hero_early_cooldown = default_train(
    "hero/moe-535b-a23b-early-cooldown",
    **{**HERO_TRAIN,
       "checkpoint": dataclasses.replace(HERO_CHECKPOINT, keep_every=None),
       "optimizer": dataclasses.replace(
           HERO_OPTIMIZER, lr_replans=((EARLY_COOLDOWN_AT_STEP, EARLY_COOLDOWN_AT_STEP + EARLY_COOLDOWN_STEPS),))},
    init_from=branch_from(hero, EARLY_COOLDOWN_AT_STEP),
    description=f"hero early cooldown: {EARLY_COOLDOWN_STEPS:,} steps of decay from step {EARLY_COOLDOWN_AT_STEP:,}",
)
# The same run trained with AdamW instead of MuonH: a variant step of its own (its own output path and
# hash; the main run's stays). Run it alone: marin run experiments/hero.py --run_only 'hero/moe-535b-a23b-adamw'
hero_adamw = default_train("hero/moe-535b-a23b-adamw", **{**HERO_TRAIN, "optimizer": HERO_ADAMW},
                           description="hero 535B-A23B on Harrier K40 with AdamW (the variant)")
hero_health = default_health_report("hero/moe-535b-a23b-health", hero, total_steps=HERO_STEPS)

if __name__ == "__main__":
    executor_main(steps=[hero_health], description="Hero MoE 535B-A23B")
