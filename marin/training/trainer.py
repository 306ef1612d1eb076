"""The training loop: one JAX process per host runs ``train_on_host``.

State (everything a resume needs, all in one pytree so one checkpoint holds it):
    params       float32 master weights (compute may be bf16, see MoEConfig.dtype)
    opt_state    AdamW moments and count (optax)
    router_bias  per-layer, per-expert balancing bias: training state, never differentiated
    rng          a raw uint32 PRNG key, split once per step (reserved for stochastic features)
The data position is the step number itself: every batch is a pure function of (data config, seed,
step, batch, seq_len), so resuming at step k replays exactly what an uninterrupted run would read.

A step: loss/grad through the model (cross entropy + z-loss, EP transport per the schedule), clip by
global norm, AdamW update with the host-computed LR, then the router bias update from the step's
statistics (outside the gradient path). Non-finite loss or grad norm stops the run before anything is
saved, so the last good checkpoint stays untouched.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from marin.training.checkpoint import CheckpointManager, CheckpointMismatchError
from marin.training.config import SyntheticDataConfig, TrainConfig, model_at
from marin.training.metrics import (
    MetricsWriter,
    ProgressLine,
    WandbTracker,
    mfu,
    peak_flops_per_device,
    phase_summary,
    read_metrics,
)
from marin.training.pools import HostContext, NonRetryableError, get_pool
from marin.training.preemption import Preempted, PreemptionWatch
from marin.training.schedule import lr_at, phase_index_at, seq_len_at, transport_at

logger = logging.getLogger(__name__)


class TrainingDiverged(NonRetryableError):
    """Loss or gradient norm became NaN/Inf; retrying the same config would diverge again."""


class IncompatibleCheckpoint(NonRetryableError):
    """The step's checkpoints were written by a different model structure; a retry cannot fix it."""


BatchFn = Callable[[int, int, int], dict[str, np.ndarray]]


# ---- data -----------------------------------------------------------------------------------------
def synthetic_batch(cfg: SyntheticDataConfig, step: int, batch_size: int, seq_len: int) -> dict[str, np.ndarray]:
    """Deterministic learnable batch: a pure function of (cfg, step, batch_size, seq_len)."""
    rng = np.random.default_rng([cfg.seed, step, batch_size, seq_len])
    v = cfg.vocab_size
    rules = np.random.default_rng([cfg.seed, 7919]).integers(1, v, size=(cfg.n_rules, 2))
    which = rng.integers(0, cfg.n_rules, size=batch_size)
    a, c = rules[which, 0][:, None], rules[which, 1][:, None]
    x = np.empty((batch_size, seq_len + 1), np.int64)
    x[:, 0] = rng.integers(0, v, size=batch_size)
    for t in range(seq_len):
        x[:, t + 1] = (a[:, 0] * x[:, t] + c[:, 0]) % v
    flip = rng.random(x.shape) < cfg.noise
    x[flip] = rng.integers(0, v, size=int(flip.sum()))
    return {"tokens": x.astype(np.int32), "segment_ids": np.ones_like(x, dtype=np.int32)}


def make_batch_fn(data: Any, total_steps: int | None = None) -> tuple[BatchFn, int]:
    """``(batch(step, B, L), vocab_size)`` for a data config: synthetic, or the mixture loader
    (``total_steps`` places mixture stages given as fractions of the run)."""
    if isinstance(data, SyntheticDataConfig):
        return (lambda step, b, l: synthetic_batch(data, step, b, l)), data.vocab_size
    from marin.data.loader import MixtureLoader

    loader = MixtureLoader(data, total_steps=total_steps)
    return loader.batch, int(loader.vocab_size)


# ---- model and optimizer --------------------------------------------------------------------------
def model_config(config: TrainConfig, vocab_size: int | None = None):
    """The MoEConfig of a run: exactly ``config.model`` (resolved when the config was built, so what
    runs is what the step's version names), checked against the data's vocabulary."""
    cfg = config.model
    if vocab_size is not None and cfg.vocab_size < vocab_size:
        raise ValueError(
            f"model {config.preset or 'config'!r} has vocab_size {cfg.vocab_size} but the data's tokenizer has "
            f"{vocab_size}; pass model_overrides={{'vocab_size': {vocab_size}}} (or a larger value)"
        )
    return cfg


def _decay_mask(params: Any) -> Any:
    """Weight decay on matrices only: norms' scales (1-D per layer stacks) are left alone."""
    return jax.tree_util.tree_map_with_path(
        lambda path, p: p.ndim >= 2 and "norm" not in jax.tree_util.keystr(path), params
    )


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """AdamW direction with clipping; the LR is applied in the step so the schedule stays on the host."""
    return optax.chain(
        optax.clip_by_global_norm(config.grad_clip),
        optax.scale_by_adam(b1=config.beta1, b2=config.beta2, eps=config.adam_eps),
        optax.add_decayed_weights(config.weight_decay, mask=_decay_mask),
    )


def _place(tree: Any, shardings: Any) -> Any:
    """Host numpy arrays -> global jax Arrays with the given shardings (works across processes)."""

    def one(x, s):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])

    return jax.tree.map(one, tree, shardings)


def state_shardings(host_state: dict[str, Any], mesh, param_sharding: str = "replicated") -> dict[str, Any]:
    """Where each state leaf lives: expert weights (and their Adam moments) split over "expert", the
    rest replicated or, with ``param_sharding="fsdp"``, split over the mesh (marin.parallel.layout).
    Fixed up front so the compiled step never re-lays-out its state; XLA gathers fsdp weights where
    the step uses them and reduce-scatters their gradients."""
    from marin.parallel.mesh import param_shardings, replicated

    rep = replicated(mesh)
    return {
        "params": param_shardings(host_state["params"], mesh, param_sharding),
        # Adam moments mirror the params' tree, so the same leaf-name rule applies; counts replicate.
        "opt_state": param_shardings(host_state["opt_state"], mesh, param_sharding),
        "router_bias": rep,
        "rng": rep,
    }


def init_host_state(config: TrainConfig, cfg) -> dict[str, Any]:
    """Fresh state as host numpy arrays: params from the seed, zero router bias, zero AdamW moments.

    Every process computes the same values from the same seed, so no broadcast is needed.
    """
    from marin.models.transformer import init_params, init_router_bias

    key = jax.random.PRNGKey(config.seed)
    init_key, train_key = jax.random.split(key)
    params = init_params(cfg, init_key)
    opt_state = make_optimizer(config).init(params)
    tree = {"params": params, "opt_state": opt_state, "router_bias": init_router_bias(cfg), "rng": train_key}
    return jax.tree.map(np.asarray, tree)


_STEP_CACHE: dict[tuple[Any, ...], Any] = {}


def make_train_step(config: TrainConfig, cfg, mesh, transport: str, shardings: dict[str, Any], microbatches: int = 1):
    """The compiled step for one transport (and, through shapes, one seq_len phase).

    Memoised per process on everything the traced program depends on, so a resumed or repeated run
    in the same process (tests, benchmarks, a pool retry) reuses the compiled executable.
    """
    key = (config.beta1, config.beta2, config.adam_eps, config.weight_decay, config.grad_clip, cfg, mesh, transport,
           jax.tree_util.tree_structure(shardings), tuple(jax.tree_util.tree_leaves(shardings)), microbatches)
    if key not in _STEP_CACHE:
        _STEP_CACHE[key] = _build_train_step(config, cfg, mesh, transport, shardings, microbatches)
    return _STEP_CACHE[key]


def _build_train_step(config: TrainConfig, cfg, mesh, transport: str, shardings: dict[str, Any], microbatches: int = 1):
    from marin.models.transformer import loss_and_stats, update_router_bias
    from marin.training.accumulate import accumulate

    tx = make_optimizer(config)
    step_cfg = cfg.replace(transport=transport)

    def step(state, tokens, segment_ids, lr):
        def loss_fn(params, tokens, segment_ids):
            return loss_and_stats(params, state["router_bias"], tokens, step_cfg, mesh=mesh,
                                  transport=transport, segment_ids=segment_ids)

        # microbatches > 1: gradient accumulation (marin.training.accumulate), same step up to float order
        (loss, stats), grads = accumulate(jax.value_and_grad(loss_fn, has_aux=True), state["params"],
                                          state["router_bias"], tokens, segment_ids, microbatches=microbatches,
                                          mesh=mesh, top_k=step_cfg.top_k)
        grad_norm = optax.global_norm(grads)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = jax.tree.map(lambda p, u: (p - lr * u).astype(p.dtype), state["params"], updates)
        bias = update_router_bias(state["router_bias"], jax.lax.stop_gradient(stats), step_cfg)
        rng = jax.random.split(state["rng"])[0]
        load = stats["expert_load"].astype(jnp.float32)  # [layers, experts]
        rel = load / jnp.maximum(jnp.mean(load, axis=-1, keepdims=True), 1e-9)
        metrics = {
            "loss": loss,
            "ce_loss": stats["ce_loss"],
            "z_loss": stats["z_loss"],
            "grad_norm": grad_norm,
            "drop_frac_send": stats["drop_frac_send"],
            "drop_frac_recv": stats["drop_frac_recv"],
            "expert_load_max": jnp.max(rel),
            "expert_load_mean": jnp.mean(jnp.max(rel, axis=-1)),
            "router_bias_spread": jnp.mean(jnp.max(bias, axis=-1) - jnp.min(bias, axis=-1)),
        }
        return {"params": params, "opt_state": opt_state, "router_bias": bias, "rng": rng}, metrics

    from marin.parallel.mesh import batch_sharding, replicated

    rep, batch = replicated(mesh), batch_sharding(mesh)
    return jax.jit(
        step, donate_argnums=(0,), in_shardings=(shardings, batch, batch, rep), out_shardings=(shardings, rep)
    )


def microbatches_for(config: TrainConfig, cfg, pool, seq_len: int, transport: str) -> int:
    """The run's microbatch count, or the smallest the memory planner says fits this phase (1 when
    none does: the step then fails with the device's own out-of-memory error)."""
    if config.microbatches is not None:
        return int(config.microbatches)
    from marin.training.planning import plan

    p = plan(cfg, pool, tokens_per_step=config.tokens_per_step, seq_len=seq_len, transport=transport,
             param_sharding=config.param_sharding)
    return p["microbatches"] or 1


# ---- the loop -------------------------------------------------------------------------------------
def _run_id(output_path: str) -> str:
    return hashlib.sha256(output_path.encode()).hexdigest()[:16]


def _config_record(config: TrainConfig) -> dict[str, Any]:
    """The run's config as JSON for W&B and checkpoint metadata, through the executor's one
    rendering, so secret-looking fields are masked exactly as in the step's records."""
    from marin.execution.jsonable import to_jsonable

    return to_jsonable(config)


def _agree(decision: bool, ctx: HostContext) -> bool:
    """Process 0's decision, on every process: a wall-time checkpoint trigger can fire on one host
    and not another, and a save is collective (sharded leaves are gathered), so all must agree."""
    if ctx.num_processes == 1:
        return decision
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.asarray(decision, dtype=np.int32)))


class _InTrainingEval:
    """The run's eval suite, loaded and packed once; :meth:`record` scores the live state with the
    same program the standalone eval step runs (marin.evaluation.step)."""

    def __init__(self, config: TrainConfig, cfg, mesh):
        from marin.evaluation.step import prepare_run_suite, run_eval_sets

        self.cfg, self.mesh = cfg, mesh
        self.suite = prepare_run_suite(config, run_eval_sets(config, config.eval_sets, config.eval_held_out), mesh,
                                       config.eval_stride)

    def record(self, state: dict[str, Any], step: int, tokens: int) -> dict[str, Any]:
        from marin.evaluation.evaluator import evaluate_prepared
        from marin.evaluation.step import metrics_record, suite_record

        totals = evaluate_prepared(state["params"], state["router_bias"], self.suite, self.cfg, self.mesh)
        return metrics_record(step, tokens, suite_record(totals))


def _stop_for_preemption(ctx: HostContext, config: TrainConfig, ckpts: CheckpointManager, step: int, state: Any,
                         meta: dict[str, Any], save_s: float | None, preemption: PreemptionWatch) -> None:
    """SIGTERM arrived: save a final checkpoint if the grace period allows (process 0 decides: the
    save is collective), then stop with :class:`Preempted`, which the executor retries from it."""
    saved = ckpts.latest_step() == step
    if not saved and _agree(preemption.worth_saving(save_s), ctx):
        ckpts.save(step, state, meta)
        saved = True
    last = ckpts.latest_step()
    where = (f"final checkpoint {ckpts.path_for(step)}" if saved else
             f"no time for a final checkpoint ({preemption.time_left():.0f}s of {config.preemption_grace_s:.0f}s "
             f"grace left, a save takes {save_s or 0:.0f}s); resumes from "
             + (ckpts.path_for(last) if last is not None else "the start"))
    raise Preempted(f"SIGTERM at step {step}: {where}")


def train_on_host(ctx: HostContext, config: TrainConfig) -> dict[str, Any]:
    """Run (or resume) the training described by ``config`` as process ``ctx.process_id`` of the pool.

    Returns a summary dict (final step, loss, tokens, checkpoint path). Raises
    :class:`TrainingDiverged` on NaN/Inf with the step number and the last good checkpoint.
    """
    from marin.models.config import flops_per_token
    from marin.parallel.mesh import batch_sharding, make_mesh

    pool = ctx.pool
    is_writer = ctx.process_id == 0
    batch_fn, vocab = make_batch_fn(config.data, config.total_steps)
    cfg = model_config(config, vocab)
    mesh = make_mesh(*pool.mesh)
    lr_sched = config.lr_schedule()
    total = lr_sched.final_total_steps
    seq_sched = config.seq_len_schedule()
    transport_sched = config.transport_schedule(cfg.transport)

    ckpts = CheckpointManager(config.output_path, config.checkpoint_policy(), is_writer=is_writer)
    host_state = init_host_state(config, cfg)
    shardings = state_shardings(host_state, mesh, config.param_sharding)
    try:
        restored = ckpts.restore_latest(template=host_state)
    except CheckpointMismatchError as e:
        raise IncompatibleCheckpoint(str(e)) from None
    start = None if restored is None else restored[0]
    tokens_seen = 0
    if restored is not None:
        start, host_state, meta = restored
        tokens_seen = int(meta["tokens"])
        ckpts.mark_restored(start)
        logger.info("resumed %s from step %d", config.output_path, start)
    step = start or 0

    metrics_out = MetricsWriter(config.output_path, resume_step=start, is_writer=is_writer)
    tracker = None
    if is_writer and config.wandb_project:
        run_name = config.run_name or config.output_path.rstrip("/").rsplit("/", 1)[-1]
        tracker = WandbTracker(project=config.wandb_project, name=run_name, config=_config_record(config),
                               output_path=config.output_path, run_id=_run_id(config.output_path))
    progress = ProgressLine(total, every_s=config.progress_every_s) if is_writer else None
    state = _place(host_state, shardings)
    del host_state
    evaluator = _InTrainingEval(config, cfg, mesh) if config.eval_every_steps else None
    peak = peak_flops_per_device(pool.accelerator)
    compiled: dict[Any, Any] = {}
    micro: dict[tuple[int, str], int] = {}  # microbatch count per (seq_len, transport) phase
    sharding = batch_sharding(mesh)
    last: dict[str, Any] = {}
    t_prev = time.perf_counter()
    exit_code = 1
    preemption = PreemptionWatch(config.preemption_grace_s).start()  # SIGTERM: a flag, checked between steps
    save_s: float | None = None  # how long the last save took: whether a final one fits the grace period
    try:
        while step < total:
            seq_len, batch_size = seq_len_at(step, total, seq_sched)
            transport = transport_at(step, transport_sched)
            phase_cfg = model_at(config, cfg, seq_len)  # the phase's remat policy, if the run sets one
            if (seq_len, transport) not in micro:
                micro[seq_len, transport] = microbatches_for(config, phase_cfg, pool, seq_len, transport)
            n_micro = micro[seq_len, transport]
            key = (transport, n_micro, phase_cfg.remat_policy)
            if key not in compiled:
                compiled[key] = make_train_step(config, phase_cfg, mesh, transport, shardings, n_micro)
            batch = batch_fn(step, batch_size, seq_len)
            tokens = _place(batch["tokens"], sharding)
            segments = _place(batch["segment_ids"], sharding)
            lr = lr_at(step, lr_sched)
            new_state, m = compiled[key](state, tokens, segments, jnp.float32(lr))
            m = {k: float(v) for k, v in m.items()}  # waits for the step
            if not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])):
                last_good = ckpts.latest_step()
                raise TrainingDiverged(
                    f"non-finite training signal at step {step + 1}: loss={m['loss']} grad_norm={m['grad_norm']}; "
                    f"stopped without saving; last good checkpoint: "
                    f"{ckpts.path_for(last_good) if last_good is not None else 'none'}"
                )
            state = new_state
            step += 1
            tokens_seen += batch_size * seq_len
            now = time.perf_counter()
            tps = batch_size * seq_len / max(now - t_prev, 1e-9)
            t_prev = now
            record = {
                "step": step,
                "tokens": tokens_seen,
                "lr": lr,
                **m,
                "tokens_per_s": tps,
                "mfu": mfu(tps, flops_per_token(cfg, seq_len), pool.num_devices, peak),
                "seq_len": seq_len,
                "batch_size": batch_size,
                "transport": transport,
                "phase": phase_index_at(step - 1, total, seq_sched),
            }
            last = record
            if step % config.log_every == 0 or step == total:
                metrics_out.log(record)
                if tracker:
                    tracker.log(record)
                if progress:
                    progress.update(record, force=step == total)
            if evaluator is not None and (step % config.eval_every_steps == 0 or step == total):
                eval_record = evaluator.record(state, step, tokens_seen)
                metrics_out.log(eval_record)
                if tracker:
                    tracker.log(eval_record)
                t_prev = time.perf_counter()  # evaluation time is not training throughput
            due = ckpts.should_save(step)
            if config.checkpoint_every_minutes is not None:  # wall time differs per host
                due = _agree(due, ctx)
            meta = {"tokens": tokens_seen, "data_step": step, "seq_len": seq_len, "transport": transport,
                    "config": _config_record(config)}
            if step == total or due:
                t_save = time.perf_counter()
                ckpts.save(step, state, meta)
                save_s = time.perf_counter() - t_save
                if tracker:
                    tracker.sync()  # W&B files of an object-store step go up with each checkpoint
                t_prev = time.perf_counter()  # checkpoint time is not training throughput
            if preemption.active and step < total and _agree(preemption.requested, ctx):
                _stop_for_preemption(ctx, config, ckpts, step, state, meta, save_s, preemption)
        exit_code = 0
    finally:
        preemption.stop()
        metrics_out.close()
        if tracker:
            tracker.finish(exit_code)
    summary = {
        "final_step": step,
        "tokens": tokens_seen,
        "final_loss": last.get("loss"),
        "checkpoint": ckpts.path_for(step),
        "resumed_from": start,
    }
    if is_writer:
        import fsspec

        summary["phases"] = phase_summary(read_metrics(config.output_path))
        with fsspec.open(f"{config.output_path.rstrip('/')}/train_summary.json", "w") as f:
            json.dump(summary, f, indent=1)
    return summary


def run_training(config: TrainConfig, *, use_ray: bool | None = None) -> dict[str, Any]:
    """Train on the configured pool: through the Ray launcher (default when Ray is initialised) or,
    for a single-host pool, in this process (needs the pool's device count visible here)."""
    import ray

    from marin.training.pools import launch, run_local

    pool = get_pool(config.pool)
    if use_ray if use_ray is not None else ray.is_initialized():
        return launch(pool, train_on_host, (config,))[0]
    return run_local(pool, train_on_host, (config,))
