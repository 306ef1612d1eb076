"""Will a training step fit its pool, and what will the run cost.

Per-device memory of a training step (parameters, gradients, fp32 master weights, optimizer state,
activations under the preset's remat policy, all-to-all buffers, logits) against the pool's device
memory; per-host memory (state shards, checkpoint staging, data buffers, runtime) against the pool's
host memory, with the checkpoint's size, bytes per host and save time; and the run's compute: FLOPs,
device-hours and days at an MFU. The grouped expert compute's buffers are counted for the
implementation the pool runs (``--grouped-impl``, default auto: the platform's rule), named per phase.
For the hero (no --seq-len, --transport or --steps) every phase the
published run uses, one per (sequence length, transport), each with its own microbatch count; for a
transport that can drop, the largest capacity factor that still fits. Exit status 1 when the step
or any phase does not fit (devices or hosts).

The pool is one of marin's (``marin/pools/pools.toml``) or one of your own, from a pools file named
by ``--pools FILE`` or ``MARIN_POOLS``; a bad file is a one-line error naming it and the field.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from marin.commands.options import add_pools, fraction, positive_float, positive_int, use_pools
from marin.data import hero_mixture
from marin.data.order import CURRENT_ORDER, format_coverage, k40_coverage
from marin.inference.planning import WEIGHT_DTYPES, format_inference_plan, inference_plan
from marin.kernels.names import GROUPED_IMPLS
from marin.models.config import PRESETS, get_preset
from marin.parallel.layout import PARAM_SHARDINGS
from marin.pools import SHIPPED_POOL_NAMES, get_pool
from marin.training.checkpoint import CheckpointPolicy
from marin.training.config import resolve_model
from marin.training.optimizers import OPTIMIZERS
from marin.training.optimizers.muonh import heuristic_hyperparameters
from marin.training.planning import (
    DEFAULT_MFU,
    STORAGE_WRITE_BYTES_PER_S,
    default_optimizer,
    format_phases,
    format_plan,
    format_storage,
    handoff_steps,
    phase_plans,
    plan_with_context_parallel,
    storage_plan,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("preset", choices=sorted(PRESETS), help="model preset")
    p.add_argument("--pool", required=True,
                   help=f"device pool: one of marin's ({', '.join(sorted(SHIPPED_POOL_NAMES))}) or one of a "
                        "pools file's (--pools)")
    add_pools(p)
    p.add_argument("--tokens-per-step", type=positive_int, default=None,
                   help="optimizer batch in tokens (default: the pool's devices x 16 sequences, or the hero's batch)")
    p.add_argument("--seq-len", type=positive_int, default=None,
                   help="sequence length (default: the preset's max_seq_len; a longer one raises the model's "
                        "context to it, as training does)")
    p.add_argument("--microbatches", type=positive_int, default=None, help="gradient accumulation count (default: the "
                   "smallest that fits)")
    p.add_argument("--transport", default=None, help="EP transport (default: the preset's; hero/ladder: fixed)")
    p.add_argument("--grouped-impl", default="auto", choices=("auto", *GROUPED_IMPLS),
                   help="the routed experts' grouped compute (parallelism.grouped_impl; default auto: what the "
                        "pool's devices run, named in the plan)")
    p.add_argument("--steps", type=positive_int, default=None, help="training steps for the compute plan")
    p.add_argument("--planned-tokens", type=positive_float, default=None,
                   help="tokens the schedule is meant to cover; a mismatch with steps x batch is flagged")
    p.add_argument("--mfu", type=fraction, default=DEFAULT_MFU, help=f"model FLOPs utilisation (default {DEFAULT_MFU})")
    p.add_argument("--remat", default=None, help="override the preset's remat policy")
    p.add_argument("--dtype", default=None, help="override the compute dtype")
    p.add_argument("--param-sharding", default="fsdp", choices=PARAM_SHARDINGS,
                   help="where weights and AdamW state live: fsdp (split over the mesh; default, as the hero and "
                        "ladder experiments run) or replicated (only routed experts split)")
    p.add_argument("--optimizer", default=None, choices=sorted(OPTIMIZERS),
                   help="the optimizer whose state is planned (default: the one the preset's experiment trains "
                        "with: muonh for hero, adamw otherwise; adamw: two moments per parameter; muonh: one "
                        "momentum buffer for the matrices, Adam's two moments for the rest, and the Newton-Schulz "
                        "temporaries)")
    p.add_argument("--storage-gbps", type=float, default=STORAGE_WRITE_BYTES_PER_S / 1e9,
                   help="write bandwidth of one host to the checkpoint store, GB/s, for the save-time estimate "
                        f"(default {STORAGE_WRITE_BYTES_PER_S / 1e9:g})")
    p.add_argument("--inference", action="store_true", help="plan sampling instead of training: weights, KV cache "
                   "and activations per device for --batch sequences of --context positions")
    p.add_argument("--batch", type=positive_int, default=1, help="with --inference: sequences decoded together")
    p.add_argument("--context", type=positive_int, default=None,
                   help="with --inference: prompt + new tokens per sequence (default: the preset's max_seq_len)")
    p.add_argument("--weights-dtype", choices=WEIGHT_DTYPES, default="float32",
                   help="with --inference: how the weights are held (float32: as the checkpoint stores them)")
    p.add_argument("--context-parallel", type=positive_int, default=None,
                   help="split each sequence over C devices of the expert axis (default: the smallest C that fits)")
    p.add_argument("--storage-quota", default=None, metavar="SIZE",
                   help="the checkpoint store's quota (100TiB, 250TB): a run whose checkpoints would exceed it at "
                        "their peak is refused (exit 1), with the checkpoint.keep_every that would fit")
    p.add_argument("--checkpoint-every", type=positive_int, default=None,
                   help="steps between permanent saves (checkpoint.every_steps; default the hero's 500, else 100)")
    p.add_argument("--keep-every", type=positive_int, default=None,
                   help="keep every checkpoint at a multiple of this step (checkpoint.keep_every; default the "
                        "hero's 10,000, else none)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


# The hero's published schedule (Marin 535B-A23B run): used when `marin plan hero` gets no --steps.
HERO_STEPS = 390_139
HERO_TOKENS_PER_STEP = 11_264 * 4096
HERO_PLANNED_TOKENS = 18.75e12
HERO_SEQ_LEN_PHASES = ((0.0, 4096), (0.5, 8192), (0.95, 65536), (0.99, 262144))  # compute follows the schedule
# experiments/hero.py's transports (fixed, then the capacity-bounded ragged transport from step 81,716)
# and its per-phase remat: `marin plan hero` plans every phase the run uses
HERO_TRANSPORT_SWITCHES = ((0, "fixed"), (81_716, "ragged_capacity"))
HERO_REMAT_BY_SEQ_LEN = ((65536, "full"), (262144, "full"))
HERO_CONTEXT_PARALLEL = ((262144, 4),)  # each 262K sequence over 4 devices of its rack's expert axis
# experiments/hero.py's checkpoints: every 500 steps (and 30 minutes), every 10,000th kept, the early-cooldown
# branch's source pinned; the transport handoff's checkpoint is pinned by the trainer (handoff_steps)
HERO_CHECKPOINT = CheckpointPolicy(every_steps=500, every_minutes=30.0, keep_every=10_000, pinned_steps=(60_000,))
# experiments/hero.py's optimizers: the main run on MuonH at upstream's size rule, AdamW the variant step
HERO_OPTIMIZER_KIND = "muonh"
HERO_WARMUP_STEPS = 2_000
HERO_ADAMW_PEAK_LR = 2.2e-4
HERO_ADAMW_STEP = "hero/moe-535b-a23b-adamw"


def hero_recipe(steps: int, tokens_per_step: int, d_model: int) -> dict:
    """The hero's recipe as experiments/hero.py declares it: its optimizer with upstream's learning
    rates at this schedule, the AdamW variant, and the mixture's stages (marin.data.hero_mixture)."""
    return {"optimizer": HERO_OPTIMIZER_KIND,
            "muonh": heuristic_hyperparameters(steps * tokens_per_step, d_model, tokens_per_step),
            "warmup_steps": HERO_WARMUP_STEPS,
            "adamw_variant": {"step": HERO_ADAMW_STEP, "peak_lr": HERO_ADAMW_PEAK_LR},
            "mixture_stages": hero_mixture.stage_lines(steps, tokens_per_step)}


def format_recipe(r: dict, planned_optimizer: str) -> str:
    """The hero's recipe block of ``marin plan hero``; says which optimizer the memory above was sized for."""
    m = r["muonh"]
    note = ("" if planned_optimizer == r["optimizer"] else
            f"\n  (the memory above is sized for --optimizer {planned_optimizer}; --optimizer {r['optimizer']} sizes "
            "the main run's)")
    return "\n".join([
        "recipe (experiments/hero.py):",
        f"  optimizer: {r['optimizer']}, upstream's learning rates for this run's size (MuonH {m['peak_lr']:.2e}, "
        f"Adam {m['adam_lr']:.2e}, beta2 {m['beta2']:.3g}), warmup {r['warmup_steps']:,} steps, decay to 5%;\n"
        f"  AdamW (peak {r['adamw_variant']['peak_lr']:.1e}) is the variant step {r['adamw_variant']['step']}{note}",
        "  mixture stages (Harrier K40):",
        *(f"  {line}" for line in r["mixture_stages"])])


def storage_of(p: dict, args: argparse.Namespace, is_hero: bool, steps: int | None) -> dict | None:
    """The checkpoint storage of the planned run (None without a step count): the hero's policy, or
    marin's defaults with --checkpoint-every / --keep-every."""
    if steps is None:
        return None
    base = HERO_CHECKPOINT if is_hero else CheckpointPolicy()
    policy = dataclasses.replace(base, every_steps=args.checkpoint_every or base.every_steps,
                                 keep_every=args.keep_every or base.keep_every)
    switches = HERO_TRANSPORT_SWITCHES if is_hero else ()
    return storage_plan(p["checkpoint_bytes"], policy, steps, quota=args.storage_quota,
                        pinned=handoff_steps(switches, policy.every_steps, steps))


def run_phases(seq_len_phases, transport_switches) -> list[tuple[int, str]]:
    """Every (sequence length, transport) combination a run's schedules can meet, in schedule order."""
    seq_lens = list(dict.fromkeys(int(n) for _, n in seq_len_phases))
    transports = list(dict.fromkeys(t for _, t in transport_switches))
    return [(n, t) for n in seq_lens for t in transports]


def _run_inference(args: argparse.Namespace) -> int:
    try:
        overrides = {"dtype": args.dtype} if args.dtype else {}
        cfg = get_preset(args.preset, **overrides)
        # the hero's run trains up to 262,144 tokens and raises its model's context to it (as the training
        # plan says): its samples can be that long; any other preset up to its own max_seq_len
        trained = max(n for _, n in HERO_SEQ_LEN_PHASES) if args.preset == "hero" else cfg.max_seq_len
        if args.context and cfg.max_seq_len < args.context <= trained:
            cfg = resolve_model(args.preset, overrides, seq_len_phases=((0.0, args.context),))
        p = inference_plan(cfg, get_pool(args.pool), batch=args.batch, context=args.context or cfg.max_seq_len,
                           weights_dtype=args.weights_dtype)
    except (KeyError, ValueError) as e:
        print(f"marin plan: error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    p["model"] = args.preset
    print(json.dumps(p, sort_keys=True) if args.json else format_inference_plan(p))
    return 0 if p["fits"] else 1


def run(args: argparse.Namespace) -> int:
    if not use_pools(args, "marin plan"):
        return 2
    if args.inference:
        return _run_inference(args)
    overrides = {k: v for k, v in (("remat_policy", args.remat), ("dtype", args.dtype)) if v is not None}
    try:
        preset = get_preset(args.preset, **overrides)
        pool = get_pool(args.pool)
        seq_len = args.seq_len or preset.max_seq_len
        transport = args.transport or (preset.transport if preset.transport != "local" or pool.mesh[1] == 1
                                       else "fixed")
        is_hero = args.preset == "hero"
        tokens_per_step = args.tokens_per_step or (HERO_TOKENS_PER_STEP if is_hero else pool.num_devices * 16 * seq_len)
        steps = args.steps if args.steps is not None else (HERO_STEPS if is_hero else None)
        planned = args.planned_tokens if args.planned_tokens is not None else (
            HERO_PLANNED_TOKENS if is_hero and args.steps is None else None)
        if args.storage_gbps <= 0:
            raise ValueError(f"--storage-gbps must be > 0, got {args.storage_gbps}")
        if args.microbatches is not None and args.microbatches < 1:
            raise ValueError(f"--microbatches must be >= 1, got {args.microbatches}")
        phases = HERO_SEQ_LEN_PHASES if is_hero and args.seq_len is None and args.steps is None else None
        # the model a run trains: the preset with its context raised to the longest sequence, as training does
        cfg = resolve_model(args.preset, overrides, seq_len_phases=phases or ((0.0, seq_len),))
        # the optimizer the run trains with: the hero's experiment is on MuonH, the ladder's and others on AdamW
        kind = args.optimizer or (HERO_OPTIMIZER_KIND if is_hero else None)
        optimizer = OPTIMIZERS[kind]() if kind else default_optimizer()
        p = plan_with_context_parallel(
                 cfg, pool, context_parallel=args.context_parallel,
                 tokens_per_step=tokens_per_step, seq_len=seq_len, microbatches=args.microbatches,
                 transport=transport, train_steps=steps, mfu=args.mfu, seq_len_phases=phases,
                 planned_tokens=planned, param_sharding=args.param_sharding,
                 storage_bytes_per_s=args.storage_gbps * 1e9, optimizer=optimizer, grouped_impl=args.grouped_impl)
        # the hero's whole run (no phase pinned by --seq-len/--transport/--steps): every phase it uses
        whole_run = phases is not None and args.transport is None
        p["phases"] = phase_plans(
            cfg, pool, tokens_per_step=tokens_per_step, microbatches=args.microbatches,
            param_sharding=args.param_sharding, optimizer=optimizer, grouped_impl=args.grouped_impl,
            phases=run_phases(HERO_SEQ_LEN_PHASES, HERO_TRANSPORT_SWITCHES) if whole_run else [(seq_len, transport)],
            remat_by_seq_len=HERO_REMAT_BY_SEQ_LEN if whole_run and args.remat is None else (),
            # a phase pinned by --seq-len: at the context parallelism the plan above chose or was given
            context_parallel_by_seq_len=HERO_CONTEXT_PARALLEL if whole_run else ((seq_len, p["context_parallel"]),))
        p["storage"] = storage_of(p, args, is_hero, steps)
        p["recipe"] = hero_recipe(steps, tokens_per_step, cfg.d_model) if whole_run and is_hero else None
    except (KeyError, ValueError) as e:
        print(f"marin plan: error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    p["model"] = args.preset
    p["max_seq_len"], p["preset_max_seq_len"] = cfg.max_seq_len, preset.max_seq_len
    p["fits"] = p["fits"] and all(ph["fits"] for ph in p["phases"]) and (
        p["storage"] is None or p["storage"]["fits_quota"])
    # data coverage: what the run reads of Harrier K40 (the ladder's and the hero's corpus), once per epoch
    p["data_coverage"] = None if p.get("train_steps") is None else k40_coverage(p["train_steps"] * p["tokens_per_step"])
    if args.json:
        print(json.dumps(p, sort_keys=True))
    else:
        print(format_plan(p))
        print(format_phases(p["phases"]))
        if p["storage"] is not None:
            print(format_storage(p["storage"]))
        if p["data_coverage"] is not None:
            print(format_coverage(p["data_coverage"], CURRENT_ORDER, "Harrier K40 at its domain shares"))
        if p["recipe"] is not None:
            print(format_recipe(p["recipe"], optimizer.kind))
        if cfg.max_seq_len > preset.max_seq_len:
            print(f"  context: {cfg.max_seq_len:,} tokens, the longest sequence trained (the preset's max_seq_len is "
                  f"{preset.max_seq_len:,}; a training run raises it the same way and records it, so sample, eval "
                  f"and export of the run take up to {cfg.max_seq_len:,})")
    return 0 if p["fits"] else 1
