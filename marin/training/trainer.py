"""The training loop: one JAX process per host runs ``train_on_host``.

State (everything a resume needs, all in one pytree so one checkpoint holds it):
    params       float32 master weights (compute may be bf16, see MoEConfig.dtype)
    opt_state    the optimizer's state (marin.training.optimizers: AdamW's moments and count, MuonH's
                 momentum buffers and Adam moments), each tree mirroring the params' keys
    router_bias  per-layer, per-expert balancing bias: training state, never differentiated
    rng          a raw uint32 PRNG key, split once per step (reserved for stochastic features)
The data position is the step number itself: every batch is a pure function of (data config, seed,
schedule, step), so resuming at step k replays exactly what an uninterrupted run would read; each
checkpoint records the data order (``data_order``), and a resume under another order is refused.

The state is never built on a host: a fresh one is created sharded on the devices by one jitted
init (``init_state``), a resumed one is restored straight into the pool's shardings, and each
process builds only its own rows of every batch (``place_batch``). A run reads top to bottom as
``setup_run`` (data, model, mesh, checkpoints, state, outputs), ``run_step`` (one optimizer step)
and ``after_step`` (logging, in-training eval, an async checkpoint), driven by ``train_loop``.

A step: loss/grad through the model (cross entropy + z-loss, EP transport per the schedule), the
optimizer's update (marin.training.optimizers: AdamW clips by global norm first) with the
host-computed LR, then the router bias update from the step's statistics (outside the gradient
path). Non-finite loss or grad norm stops the run before anything is saved, so the last good checkpoint stays untouched.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import fsspec
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils

from marin.data.loader import MixtureLoader
from marin.data.order import WITH_REPLACEMENT, DataPhase, data_schedule
from marin.evaluation.evaluator import evaluate_prepared
from marin.evaluation.metrics import suite_metrics
from marin.evaluation.multiple_choice import prepare_run_tasks, score_prepared_task
from marin.evaluation.suite import metrics_record, prepare_run_suite, run_eval_sets
from marin.execution.jsonable import to_jsonable
from marin.models.config import flops_per_token
from marin.models.transformer import init_params, init_router_bias, loss_and_stats, update_router_bias
from marin.parallel.mesh import batch_sharding, make_mesh, param_shardings, replicated
from marin.pools import HostContext, NonRetryableError, launch, run_local
from marin.pools.stall import report_phase, report_step
from marin.training.accumulate import accumulate
from marin.training.checkpoint.discovery import checkpoint_path, checkpoint_step
from marin.training.checkpoint.format import PERMANENT, TEMPORARY, CheckpointMismatchError, read_metadata
from marin.training.checkpoint.manager import CheckpointManager, pin_checkpoint
from marin.training.checkpoint.restore import restore_checkpoint
from marin.training.compiled_memory import check_train_step
from marin.training.config import SyntheticDataConfig, TrainConfig, model_at
from marin.training.cutover import check_cutovers
from marin.training.metrics import (
    MetricsWriter,
    ProgressLine,
    WandbTracker,
    mfu,
    peak_flops_per_device,
    phase_summary,
    read_metrics,
)
from marin.training.optimizers import kind_of_record
from marin.training.planning import plan, transport_handoffs
from marin.training.preemption import Preempted, PreemptionWatch, StopRequested
from marin.training.schedule import lr_at, phase_index_at, seq_len_at, transport_at

logger = logging.getLogger(__name__)


STALLS_FILE = "stalls.json"
"""In a training step's directory: every stall the launcher's watchdog found (when, which hosts were
behind), one JSON list."""


class TrainingDiverged(NonRetryableError):
    """Loss or gradient norm became NaN/Inf; retrying the same config would diverge again."""


class IncompatibleCheckpoint(NonRetryableError):
    """The step's checkpoints were written by a different model structure; a retry cannot fix it."""


BatchFn = Callable[..., dict[str, np.ndarray]]  # (step, batch_size, seq_len, rows=None) -> tokens, segment_ids


# ---- data -----------------------------------------------------------------------------------------
def synthetic_batch(cfg: SyntheticDataConfig, step: int, batch_size: int, seq_len: int,
                    rows: slice | None = None) -> dict[str, np.ndarray]:
    """Deterministic learnable batch: a pure function of (cfg, step, batch_size, seq_len). ``rows``
    selects rows of it (generated whole: synthetic tokens read nothing from storage)."""
    if rows is not None:
        return {k: v[rows] for k, v in synthetic_batch(cfg, step, batch_size, seq_len).items()}
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


def make_batch_fn(data: Any, total_steps: int | None = None, schedule: Any = None) -> tuple[BatchFn, int]:
    """``(batch(step, B, L), vocab_size)`` for a data config: synthetic, or the mixture loader
    (``total_steps`` places mixture stages given as fractions of the run; ``schedule``, the run's
    batch shapes (:func:`marin.data.order.data_schedule`), lets the without-replacement order count
    each source's tokens across sequence-length phases)."""
    if isinstance(data, SyntheticDataConfig):
        return (lambda step, b, l, rows=None: synthetic_batch(data, step, b, l, rows)), data.vocab_size
    loader = MixtureLoader(data, total_steps=total_steps, schedule=schedule)
    return loader.batch, int(loader.vocab_size)


def data_order_of(data: Any) -> str:
    """The data order a run reads (recorded with every checkpoint): the mixture's ``order`` (a config
    recorded before the field existed reads as the legacy order), or "synthetic"."""
    if isinstance(data, SyntheticDataConfig):
        return "synthetic"
    return str(getattr(data, "order", WITH_REPLACEMENT))


def run_data_schedule(config: TrainConfig) -> tuple[DataPhase, ...]:
    """The batch shape of every step of a run, as the trainer's phases place them (the horizon after
    re-plans, the same rounding as :func:`marin.training.schedule.seq_len_at`)."""
    return data_schedule(config.total_steps, config.tokens_per_step, config.seq_len_phases)


def host_rows(sharding, batch_size: int, seq_len: int) -> slice:
    """The rows of a [batch_size, seq_len + 1] global batch that this process's devices hold under
    ``sharding`` (one contiguous span: devices are ordered host by host along the batch axis)."""
    spans = [idx[0].indices(batch_size)[:2] for idx in
             sharding.addressable_devices_indices_map((batch_size, seq_len + 1)).values()]
    return slice(min(a for a, _ in spans), max(b for _, b in spans))


def place_batch(batch_fn: BatchFn, sharding, step: int, batch_size: int, seq_len: int) -> tuple[Any, Any]:
    """(tokens, segment_ids) of batch ``step`` as global arrays split over ``sharding``: this process
    builds (and reads the documents of) only its own rows; the assembled global batch is the one
    ``batch_fn(step, batch_size, seq_len)`` builds whole."""
    rows = host_rows(sharding, batch_size, seq_len)
    local = batch_fn(step, batch_size, seq_len, rows=rows)
    shape = (batch_size, seq_len + 1)

    def place(x: np.ndarray):
        return jax.make_array_from_callback(
            shape, sharding, lambda idx: x[slice(idx[0].indices(batch_size)[0] - rows.start,
                                                 idx[0].indices(batch_size)[1] - rows.start), idx[1]])

    return place(local["tokens"]), place(local["segment_ids"])


# ---- model and optimizer --------------------------------------------------------------------------
def model_config(config: TrainConfig, vocab_size: int | None = None):
    """The MoEConfig of a run: exactly ``config.model`` (resolved when the config was built, so what
    runs is what the step's version names), checked against the data's vocabulary."""
    cfg = config.model
    if vocab_size is not None and cfg.vocab_size < vocab_size:
        raise ValueError(
            f"model {config.preset or 'config'!r} has vocab_size {cfg.vocab_size} but the data's tokenizer has "
            f"{vocab_size}; pass model=<the model>.replace(vocab_size={vocab_size}) (or a larger value)"
        )
    return cfg


def make_optimizer(config: TrainConfig) -> optax.GradientTransformationExtraArgs:
    """The run's optimizer (``config.optimizer``: AdamW or MuonH, marin.training.optimizers) as an
    optax transformation whose ``update(grads, state, params, lr=...)`` gives each parameter's change;
    the LR is fed to the step so the schedule stays on the host."""
    return config.optimizer.transformation()


def state_shardings(state: dict[str, Any], mesh, param_sharding: str = "replicated") -> dict[str, Any]:
    """Where each state leaf lives: expert weights (and their Adam moments) split over "expert", the
    rest replicated or, with ``param_sharding="fsdp"``, split over the mesh (marin.parallel.layout).
    ``state`` may be arrays or ``jax.ShapeDtypeStruct``s (:func:`state_shapes`). Fixed up front so the
    compiled step never re-lays-out its state; XLA gathers fsdp weights where the step uses them and
    reduce-scatters their gradients."""
    rep = replicated(mesh)
    return {
        "params": param_shardings(state["params"], mesh, param_sharding),
        # Adam moments mirror the params' tree, so the same leaf-name rule applies; counts replicate.
        "opt_state": param_shardings(state["opt_state"], mesh, param_sharding),
        "router_bias": rep,
        "rng": rep,
    }


def fresh_state(config: TrainConfig, cfg) -> dict[str, Any]:
    """The fresh state as a pure function of the seed: params, the optimizer's fresh state, zero router bias,
    the training PRNG key. Traced by :func:`init_state` (never run eagerly for a real model)."""
    init_key, train_key = jax.random.split(jax.random.PRNGKey(config.seed))
    params = init_params(cfg, init_key)
    return {"params": params, "opt_state": make_optimizer(config).init(params),
            "router_bias": init_router_bias(cfg), "rng": train_key}


def state_shapes(config: TrainConfig, cfg) -> dict[str, Any]:
    """Shapes and dtypes of the state (``jax.ShapeDtypeStruct``s; nothing is allocated)."""
    return jax.eval_shape(lambda: fresh_state(config, cfg))


_INIT_CACHE: dict[tuple[Any, ...], Any] = {}


def _init_program(config: TrainConfig, cfg, mesh=None, shardings: dict[str, Any] | None = None):
    """The jitted fresh-state program, memoised per process on what it depends on (the seed, the
    optimizer's settings, the model, the output shardings): compiling it takes seconds even for a
    tiny model, and a process that retries or repeats a run needs it again."""
    key = (config.seed, config.optimizer.program_key(), cfg, mesh,
           jax.tree_util.tree_structure(shardings), tuple(jax.tree_util.tree_leaves(shardings)))
    if key not in _INIT_CACHE:
        _INIT_CACHE[key] = jax.jit(lambda: fresh_state(config, cfg), out_shardings=shardings)
    return _INIT_CACHE[key]


def init_state(config: TrainConfig, cfg, mesh, shardings: dict[str, Any]) -> dict[str, Any]:
    """The fresh state created directly in its final shardings: one jitted program whose
    ``out_shardings`` are the state's, so each device computes only its own shards and no process
    ever holds the whole state (the hero's is about 6.4 TB). The values do not depend on the mesh or
    the process count: JAX's partitionable threefry (``jax_threefry_partitionable``, on by default)
    makes every random bit a function of the key and the element's global index only."""
    if not jax.config.jax_threefry_partitionable:
        raise RuntimeError("sharded init needs jax_threefry_partitionable=True (JAX's default); it was turned off")
    return _init_program(config, cfg, mesh, shardings)()


def init_host_state(config: TrainConfig, cfg) -> dict[str, Any]:
    """The fresh state as host numpy arrays (new ones on every call), for tests and benchmarks of
    small models only (the trainer creates it sharded with :func:`init_state`; these are the same
    values)."""
    return jax.tree.map(np.array, _init_program(config, cfg)())


_STEP_CACHE: dict[tuple[Any, ...], Any] = {}


def make_train_step(config: TrainConfig, cfg, mesh, transport: str, shardings: dict[str, Any], microbatches: int = 1):
    """The compiled step for one transport (and, through shapes, one seq_len phase).

    Memoised per process on everything the traced program depends on, so a resumed or repeated run
    in the same process (tests, benchmarks, a pool retry) reuses the compiled executable.
    """
    key = (config.optimizer.program_key(), cfg, mesh, transport, config.parallelism.grouped_impl,
           jax.tree_util.tree_structure(shardings), tuple(jax.tree_util.tree_leaves(shardings)), microbatches)
    if key not in _STEP_CACHE:
        _STEP_CACHE[key] = build_train_step(config, cfg, mesh, transport, shardings, microbatches)
    return _STEP_CACHE[key]


def build_train_step(config: TrainConfig, cfg, mesh, transport: str, shardings: dict[str, Any], microbatches: int = 1):
    """The jitted train step, built anew (:func:`make_train_step` memoises it); the CUDA lowering
    check (marin.training.lowering) traces this same program without running it."""
    tx = make_optimizer(config)
    step_cfg = cfg.replace(transport=transport)

    def step(state, tokens, segment_ids, lr):
        def loss_fn(params, tokens, segment_ids):
            return loss_and_stats(params, state["router_bias"], tokens, step_cfg, mesh=mesh,
                                  transport=transport, segment_ids=segment_ids,
                                  grouped_impl=config.parallelism.grouped_impl)

        # microbatches > 1: gradient accumulation (marin.training.accumulate), same step up to float order
        (loss, stats), grads = accumulate(jax.value_and_grad(loss_fn, has_aux=True), state["params"],
                                          state["router_bias"], tokens, segment_ids, microbatches=microbatches,
                                          mesh=mesh, top_k=step_cfg.top_k, context_parallel=step_cfg.context_parallel)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"], lr=lr)
        params = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), state["params"], updates)
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

    rep, batch = replicated(mesh), batch_sharding(mesh, cfg.context_parallel)
    return jax.jit(
        step, donate_argnums=(0,), in_shardings=(shardings, batch, batch, rep), out_shardings=(shardings, rep)
    )


def microbatches_for(config: TrainConfig, cfg, pool, seq_len: int, transport: str) -> int:
    """The run's microbatch count, or the smallest the memory planner says fits this phase (1 when
    none does: the step then fails with the device's own out-of-memory error)."""
    if config.parallelism.microbatches is not None:
        return int(config.parallelism.microbatches)
    p = plan(cfg, pool, tokens_per_step=config.tokens_per_step, seq_len=seq_len, transport=transport,
             param_sharding=config.parallelism.param_sharding, optimizer=config.optimizer,
             grouped_impl=config.parallelism.grouped_impl)
    return p["microbatches"] or 1


# ---- the loop -------------------------------------------------------------------------------------
def _run_id(output_path: str) -> str:
    return hashlib.sha256(output_path.encode()).hexdigest()[:16]


def _config_record(config: TrainConfig) -> dict[str, Any]:
    """The run's config as JSON for W&B and checkpoint metadata, through the executor's one
    rendering, so secret-looking fields are masked exactly as in the step's records."""
    return to_jsonable(config)


def _agree(decision: bool, ctx: HostContext) -> bool:
    """Process 0's decision, on every process: a wall-time checkpoint trigger can fire on one host
    and not another, and a save is collective (sharded leaves are gathered), so all must agree."""
    if ctx.num_processes == 1:
        return decision
    return bool(multihost_utils.broadcast_one_to_all(np.asarray(decision, dtype=np.int32)))


_TIERS = (None, TEMPORARY, PERMANENT)


def _agree_tier(tier: str | None, ctx: HostContext) -> str | None:
    """Process 0's choice of checkpoint tier (or none), on every process (see :func:`_agree`)."""
    if ctx.num_processes == 1:
        return tier
    return _TIERS[int(multihost_utils.broadcast_one_to_all(np.asarray(_TIERS.index(tier), dtype=np.int32)))]


class _InTrainingEval:
    """The run's eval suite and tasks, loaded, tokenized and packed once; :meth:`record` scores the
    live state with the same suite, tasks and programs the standalone eval step runs
    (marin.inference.evaluate). Every process builds the same rows and scores its own shards, so it
    works on a mesh that spans processes."""

    def __init__(self, config: TrainConfig, cfg, mesh):
        self.cfg, self.mesh = cfg, mesh
        sets = run_eval_sets(config, config.evaluation.sets, config.evaluation.held_out)
        self.suite = None  # a run may score tasks only; with neither, prepare_run_suite says "nothing to evaluate"
        if sets or not config.evaluation.tasks:
            self.suite = prepare_run_suite(config, sets, mesh, config.evaluation.stride)
        self.tasks = prepare_run_tasks(config, config.evaluation.tasks, mesh)

    def record(self, state: dict[str, Any], step: int, tokens: int) -> dict[str, Any]:
        params, bias = state["params"], state["router_bias"]
        suite = (suite_metrics(evaluate_prepared(params, bias, self.suite, self.cfg, self.mesh))
                 if self.suite is not None else None)
        tasks = {name: score_prepared_task(t, params, bias, self.cfg, self.mesh) for name, t in self.tasks.items()}
        return metrics_record(step, tokens, suite, tasks)


def _stop_for_preemption(ctx: HostContext, config: TrainConfig, ckpts: CheckpointManager, step: int, state: Any,
                         meta: dict[str, Any], save_s: float | None, preemption: PreemptionWatch) -> None:
    """SIGTERM arrived, or the driver's stop request: save a final checkpoint if the grace period
    allows (process 0 decides: the save is collective), then stop with :class:`Preempted`, which the
    executor retries from it, or, for the driver's request, :class:`StopRequested` (the run is ending)."""
    report_phase("checkpoint")
    ckpts.wait()  # a save of this step may still be in flight: it counts once committed
    saved = ckpts.latest_step() == step
    if not saved and _agree(preemption.worth_saving(save_s), ctx):
        ckpts.save(step, state, meta, blocking=True)
        saved = True
    last = ckpts.latest_step()
    where = (f"final checkpoint {ckpts.path_for(step)}" if saved else
             f"no time for a final checkpoint ({preemption.time_left():.0f}s of {preemption.grace_s:.0f}s "
             f"grace left, a save takes {save_s or 0:.0f}s); resumes from "
             + (ckpts.path_for(last) if last is not None else "the start"))
    if _agree(preemption.by_driver, ctx):  # every host raises the same (the launcher retries a Preempted)
        raise StopRequested(f"training stopped at step {step}: {where}")
    raise Preempted(f"SIGTERM at step {step}: {where}")


@dataclasses.dataclass
class TrainRun:
    """One process's view of a run: what :func:`setup_run` builds once, and the loop's live state."""

    ctx: HostContext
    config: TrainConfig
    cfg: Any  # MoEConfig
    mesh: Any
    batch_fn: BatchFn
    shardings: dict[str, Any]
    state: dict[str, Any]
    ckpts: CheckpointManager
    metrics_out: MetricsWriter
    step: int = 0
    tokens_seen: int = 0
    resumed_from: int | None = None
    tracker: WandbTracker | None = None
    progress: ProgressLine | None = None
    evaluator: _InTrainingEval | None = None
    compiled: dict[Any, Any] = dataclasses.field(default_factory=dict)  # per (transport, microbatches, remat)
    micro: dict[tuple[int, str], int] = dataclasses.field(default_factory=dict)  # per (seq_len, transport)
    memory_checked: set[Any] = dataclasses.field(default_factory=set)  # compiled programs held against the plan
    last: dict[str, Any] = dataclasses.field(default_factory=dict)
    t_prev: float = 0.0
    preemption: PreemptionWatch | None = None  # SIGTERM watch, started by train_on_host
    final_meta: dict[str, Any] | None = None  # the last step's checkpoint metadata, once it is reached

    @property
    def is_writer(self) -> bool:
        return self.ctx.process_id == 0

    @property
    def total(self) -> int:
        return self.config.lr_schedule().final_total_steps


def restore_or_init(ctx: HostContext, config: TrainConfig, cfg, mesh, ckpts: CheckpointManager
                    ) -> tuple[dict[str, Any], dict[str, Any], int | None, int]:
    """``(state, shardings, resumed_from, tokens_seen)``: the newest valid checkpoint of this run,
    restored straight into this pool's shardings (whatever pool wrote it), or else the fresh state
    created sharded (:func:`init_state`). Neither path builds the state on the host."""
    shapes = state_shapes(config, cfg)
    shardings = state_shardings(shapes, mesh, config.parallelism.param_sharding)
    if ctx.process_id == 0:
        ckpts.clear_uncommitted()  # a crashed save's leftovers; no save of this attempt races this
    try:
        restored = ckpts.restore_latest(template=shapes, shardings=shardings)
    except CheckpointMismatchError as e:
        raise IncompatibleCheckpoint(str(e)) from None
    if ctx.num_processes > 1:
        multihost_utils.sync_global_devices("marin: checkpoints cleared and restored")
    if restored is None and config.init_from is not None:
        state, start, tokens = branch_state(config, cfg, mesh, shapes, shardings)
        return state, shardings, start, tokens
    if restored is None:
        return init_state(config, cfg, mesh, shardings), shardings, None, 0
    start, state, meta = restored
    # a checkpoint written before the order was recorded read the only order there was then
    recorded = meta.get("data_order") or ("synthetic" if isinstance(config.data, SyntheticDataConfig)
                                          else WITH_REPLACEMENT)
    if recorded != data_order_of(config.data):
        raise IncompatibleCheckpoint(f"{config.output_path}: its checkpoint at step {start} was written reading data "
                                     f"order {recorded!r}, but this run reads {data_order_of(config.data)!r}; resume "
                                     f"with the order the run started with (MixtureConfig.order)")
    ckpts.mark_restored(start)
    logger.info("resumed %s from step %d", config.output_path, start)
    return state, shardings, start, int(meta["tokens"])


def branch_state(config: TrainConfig, cfg, mesh, shapes: dict[str, Any], shardings: dict[str, Any]
                 ) -> tuple[dict[str, Any], int | None, int]:
    """``(state, start step, tokens)`` of a run that starts from another run's checkpoint
    (``config.init_from``), resharded onto this run's mesh: weights and router bias always, the AdamW
    state when asked (else fresh moments for the weights), the data position when asked (else step 0).
    The training PRNG key is the source's with the data position, else this run's own."""
    src = config.init_from
    step = checkpoint_step(src.run, int(src.step))
    path = checkpoint_path(src.run, step)
    if src.optimizer:  # another optimizer's state cannot continue this one's
        check_same_optimizer(config, read_metadata(path).get("config"), path)
    if jax.process_index() == 0:  # the source's retention (a run still going) must never delete it
        pin_checkpoint(src.run, step, by=config.output_path)
    wanted = ["params", "router_bias"] + (["opt_state"] if src.optimizer else []) + (["rng"] if src.data_position
                                                                                     else [])
    try:
        part, meta = restore_checkpoint(path, {k: shapes[k] for k in wanted}, {k: shardings[k] for k in wanted},
                                        partial=True)
    except CheckpointMismatchError as e:
        raise IncompatibleCheckpoint(f"init_from: {e}") from None
    state = dict(part)
    if not src.optimizer:
        tx = make_optimizer(config)
        state["opt_state"] = jax.jit(tx.init, out_shardings=shardings["opt_state"])(state["params"])
    if not src.data_position:
        state["rng"] = jax.jit(lambda: jax.random.split(jax.random.PRNGKey(config.seed))[1],
                               out_shardings=shardings["rng"])()
    logger.info("%s starts from %s (optimizer state: %s, data position: %s)", config.output_path, path,
                src.optimizer, src.data_position)
    if src.data_position:
        return state, step, int(meta["tokens"])
    return state, None, 0


def check_same_optimizer(config: TrainConfig, source_record: dict[str, Any] | None, where: str) -> None:
    """Refuse, in one line, a branch that takes the optimizer state (``init_from.optimizer``) of a
    source trained with another optimizer: the state's shape is the optimizer's own."""
    if source_record is None:
        return
    source = kind_of_record(source_record.get("optimizer"))
    if source != config.optimizer.kind:
        raise IncompatibleCheckpoint(
            f"init_from: {where} holds {source} state but this run trains with {config.optimizer.kind}; "
            "switching optimizers needs a fresh optimizer state: branch_from(..., optimizer=False)")


def setup_run(ctx: HostContext, config: TrainConfig) -> TrainRun:
    """Data, model, mesh, checkpoints, state and outputs of a run on this process."""
    batch_fn, vocab = make_batch_fn(config.data, config.total_steps, run_data_schedule(config))
    cfg = model_config(config, vocab)
    mesh = make_mesh(*ctx.pool.mesh)
    is_writer = ctx.process_id == 0
    ckpts = CheckpointManager(config.output_path, config.checkpoint, is_writer=is_writer,
                              temp_path=config.checkpoint.temp_path, handoffs=transport_handoffs(config))
    state, shardings, start, tokens_seen = restore_or_init(ctx, config, cfg, mesh, ckpts)
    run = TrainRun(ctx=ctx, config=config, cfg=cfg, mesh=mesh, batch_fn=batch_fn, shardings=shardings, state=state,
                   ckpts=ckpts, metrics_out=MetricsWriter(config.output_path, resume_step=start, is_writer=is_writer),
                   step=start or 0, tokens_seen=tokens_seen, resumed_from=start)
    if is_writer and config.telemetry.wandb_project:
        run_name = config.telemetry.run_name or config.output_path.rstrip("/").rsplit("/", 1)[-1]
        run.tracker = WandbTracker(project=config.telemetry.wandb_project, name=run_name, config=_config_record(config),
                                   output_path=config.output_path, run_id=_run_id(config.output_path))
    if is_writer:
        run.progress = ProgressLine(run.total, every_s=config.telemetry.progress_every_s)
    if config.evaluation.every_steps:
        run.evaluator = _InTrainingEval(config, cfg, mesh)
    return run


def run_step(run: TrainRun) -> dict[str, Any]:
    """One optimizer step at ``run.step``: the phase's compiled program on this step's batch. Returns
    the step's metrics record; the state advances only when the loss and grad norm are finite."""
    config, total = run.config, run.total
    t_start = time.perf_counter()
    seq_sched = config.seq_len_schedule()
    seq_len, batch_size = seq_len_at(run.step, total, seq_sched)
    transport = transport_at(run.step, config.transport_schedule(run.cfg.transport))
    phase_cfg = model_at(config, run.cfg, seq_len)  # the phase's remat policy, if the run sets one
    if (seq_len, transport) not in run.micro:
        run.micro[seq_len, transport] = microbatches_for(config, phase_cfg, run.ctx.pool, seq_len, transport)
    n_micro = run.micro[seq_len, transport]
    key = (transport, n_micro, phase_cfg.remat_policy, phase_cfg.context_parallel)
    if key not in run.compiled:
        report_phase("compile")  # the first call compiles: the stall watchdog allows for it
        run.compiled[key] = make_train_step(config, phase_cfg, run.mesh, transport, run.shardings, n_micro)
    tokens, segments = place_batch(run.batch_fn, batch_sharding(run.mesh, phase_cfg.context_parallel), run.step,
                                   batch_size, seq_len)
    lr = lr_at(run.step, config.lr_schedule())
    if (key, seq_len) not in run.memory_checked:  # before the program's first step: its memory against the plan
        check_train_step(run.compiled[key], (run.state, tokens, segments, jnp.float32(lr)), config=config,
                         cfg=phase_cfg, pool=run.ctx.pool, seq_len=seq_len, transport=transport, microbatches=n_micro)
        run.memory_checked.add((key, seq_len))
    new_state, m = run.compiled[key](run.state, tokens, segments, jnp.float32(lr))
    m = {k: float(v) for k, v in m.items()}  # waits for the step
    if not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])):
        last_good = run.ckpts.latest_step()
        raise TrainingDiverged(
            f"non-finite training signal at step {run.step + 1}: loss={m['loss']} grad_norm={m['grad_norm']}; "
            f"stopped without saving; last good checkpoint: "
            f"{run.ckpts.path_for(last_good) if last_good is not None else 'none'}"
        )
    run.state = new_state
    run.step += 1
    run.tokens_seen += batch_size * seq_len
    now = time.perf_counter()
    report_step(run.step, now - t_start)  # the heartbeat the pool launcher's stall watchdog measures
    tps = batch_size * seq_len / max(now - run.t_prev, 1e-9)
    run.t_prev = now
    pool = run.ctx.pool
    return {
        "step": run.step,
        "tokens": run.tokens_seen,
        "lr": lr,
        **m,
        "tokens_per_s": tps,
        "mfu": mfu(tps, flops_per_token(run.cfg, seq_len), pool.num_devices, peak_flops_per_device(pool.accelerator)),
        "seq_len": seq_len,
        "batch_size": batch_size,
        "transport": transport,
        "phase": phase_index_at(run.step - 1, total, seq_sched),
    }


def after_step(run: TrainRun, record: dict[str, Any]) -> None:
    """Log the step, run the in-training eval and start a checkpoint when they are due."""
    config, step, total = run.config, run.step, run.total
    run.last = record
    run.ckpts.check()  # a background save that ended: counted below if it failed (raised past the limit)
    if run.ckpts.failed_saves:  # counted in the metrics from the first failure on (marin health flags it)
        record["checkpoint_failed_saves"] = run.ckpts.failed_saves
    if step % config.telemetry.log_every == 0 or step == total:
        run.metrics_out.log(record)
        if run.tracker:
            run.tracker.log(record)
        if run.progress:
            run.progress.update(record, force=step == total)
    if run.evaluator is not None and (step % config.evaluation.every_steps == 0 or step == total):
        report_phase("eval")
        eval_record = run.evaluator.record(run.state, step, run.tokens_seen)
        run.metrics_out.log(eval_record)
        if run.tracker:
            run.tracker.log(eval_record)
        run.t_prev = time.perf_counter()  # evaluation time is not training throughput
    run.ckpts.check()  # a background save that failed stops the run here, before more work is lost
    tier = PERMANENT if step == total else run.ckpts.due(step)
    if config.checkpoint.every_minutes is not None or config.checkpoint.temp_every_minutes is not None:
        tier = _agree_tier(tier, run.ctx)  # wall time differs per host
    meta = {"tokens": run.tokens_seen, "data_step": step, "seq_len": record["seq_len"],
            "transport": record["transport"], "data_order": data_order_of(config.data),
            "config": _config_record(config)}
    if step == total:
        run.final_meta = meta
    if tier is not None:
        # async: blocks only while this process's shards are copied to host memory
        if tier == TEMPORARY:
            run.ckpts.save_temporary(step, run.state, meta)
        else:
            run.ckpts.save(step, run.state, meta)
        if run.tracker:
            run.tracker.sync()  # W&B files of an object-store step go up with each checkpoint
        run.t_prev = time.perf_counter()  # checkpoint time is not training throughput
    watch = run.preemption
    if watch is not None and watch.active and step < total and _agree(watch.requested, run.ctx):
        # how long a whole save took (staging and writing): whether a final one fits the grace period
        _stop_for_preemption(run.ctx, config, run.ckpts, step, run.state, meta, run.ckpts.last_save_s, watch)


def train_loop(run: TrainRun) -> dict[str, Any]:
    """Steps until the run's total; the final checkpoint is committed before this returns."""
    run.t_prev = time.perf_counter()
    while run.step < run.total:
        after_step(run, run_step(run))
    report_phase("checkpoint")
    if run.final_meta is not None:  # a failed final save is tried again
        run.ckpts.ensure_saved(run.step, run.state, run.final_meta)
    else:  # resumed at the end: the final checkpoint is the one restored
        run.ckpts.wait()
    return {
        "final_step": run.step,
        "tokens": run.tokens_seen,
        "final_loss": run.last.get("loss"),
        "checkpoint": run.ckpts.path_for(run.step),
        "resumed_from": run.resumed_from,
        "checkpoint_failed_saves": run.ckpts.failed_saves,
    }


def train_on_host(ctx: HostContext, config: TrainConfig) -> dict[str, Any]:
    """Run (or resume) the training described by ``config`` as process ``ctx.process_id`` of the pool.

    Returns a summary dict (final step, loss, tokens, checkpoint path). Raises
    :class:`TrainingDiverged` on NaN/Inf with the step number and the last good checkpoint, and
    :class:`Preempted` after a SIGTERM, :class:`StopRequested` after the driver's stop request (both with a
    final checkpoint when the grace period allows).
    """
    run = setup_run(ctx, config)
    exit_code = 1
    # SIGTERM, or the driver's stop request in the step directory (process 0 looks for all): a flag,
    # checked between steps
    run.preemption = PreemptionWatch(config.checkpoint.preemption_grace_s,
                                     step_dir=config.output_path if ctx.process_id == 0 else None).start()
    try:
        summary = train_loop(run)
        exit_code = 0
    finally:
        run.preemption.stop()
        try:
            run.ckpts.close()  # the save in flight is committed (or its error raised) before we return
        except Exception:
            if exit_code == 0:
                raise
            logger.exception("the checkpoint in flight failed too")  # the training error is the story
        finally:
            run.metrics_out.close()
            if run.tracker:
                run.tracker.finish(exit_code)
    if run.is_writer:
        summary["phases"] = phase_summary(read_metrics(config.output_path))
        with fsspec.open(f"{config.output_path.rstrip('/')}/train_summary.json", "w") as f:
            json.dump(summary, f, indent=1)
    return summary


def run_training(config: TrainConfig, *, use_ray: bool | None = None) -> dict[str, Any]:
    """Train on the configured pool: through the Ray launcher (default when Ray is initialised) or,
    for a single-host pool, in this process (needs the pool's device count visible here)."""
    import ray  # Ray: only to launch on a pool; importing the trainer (lowering, benchmarks) must not start it


    pool = config.pool
    for c in check_cutovers(config):  # a change resting on a failed gate is refused before the pool starts
        logger.info("cutover at step %d rests on gate %s (%s)%s: %s", c["step"], c["gate"], c["candidate"],
                    " FORCED" if c["forced"] else "", c["verdict"])
    if use_ray if use_ray is not None else ray.is_initialized():
        return launch(pool, train_on_host, (config,), step_dir=config.output_path, stall=config.stall,
                      stall_log=f"{config.output_path.rstrip('/')}/{STALLS_FILE}")[0]
    return run_local(pool, train_on_host, (config,))
