"""The training step's configuration (JAX-free, so experiment files and the CLI import it cheaply).

A :class:`TrainConfig` is what ``default_train`` puts into the executor step; everything the run needs
is in it, grouped by concept: the run itself (model, data, seed, horizon, batch, sequence phases),
then ``optimizer``, ``checkpoint``, ``stall``, ``evaluation``, ``telemetry`` and ``parallelism``,
each a frozen dataclass with its own defaults and checks (``CheckpointPolicy`` and ``StallRule`` are
the checkpoint manager's and the stall watchdog's own, importable from here). Every field is part of
the run's version unless it is declared live, with why (:mod:`marin.execution.versioning`): what an
operator may change on a running run (the pool, horizon re-plans, the transport switch, checkpoint
cadence, telemetry) keeps its output path, so the step resumes from its checkpoints. In the hash a
group's fields are named as TrainConfig's own (``peak_lr``, not ``optimizer.peak_lr``), so grouping
moved no step's hash; in-training evaluation's dependencies are named by their path
(``evaluation.sets[0].store``). The model is carried as a :class:`~marin.models.config.MoEConfig`
(every field versioned), so editing a preset changes the version of every run that uses it; the
trainer builds exactly that model.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

from marin.data.mixture import MixtureConfig
from marin.data.order import WITHOUT_REPLACEMENT_V1, block_length
from marin.evaluation.sets import EvalSet
from marin.execution.fieldcheck import FieldError, check_fields, check_number
from marin.execution.jsonable import from_jsonable
from marin.execution.step import ExecutorStep, InputName, VersionedValue
from marin.execution.versioning import by_field, group, input_field, live
from marin.kernels.names import canonical_grouped_impl
from marin.models.config import REMAT_POLICIES, TRANSPORTS, MoEConfig, get_preset
from marin.parallel.layout import PARAM_SHARDINGS
from marin.pools import PoolSpec, as_pool
from marin.pools.stall import StallRule
from marin.training.checkpoint.manager import CheckpointPolicy
from marin.training.optimizers import AdamWConfig, OptimizerBase, optimizer_from, optimizer_type
from marin.training.schedule import (
    LRSchedule,
    SeqLenPhase,
    SeqLenSchedule,
    TransportSchedule,
)


@dataclasses.dataclass(frozen=True)
class SyntheticDataConfig:
    """A learnable token stream that needs no files: for unit tests and benchmarks only.

    Each sequence follows ``x[t+1] = (a * x[t] + c) mod V`` with a per-sequence ``(a, c)`` drawn from a
    small set, plus ``noise`` random substitutions: a model can learn it, so loss visibly falls.
    """

    vocab_size: int = 512
    seed: int = 0
    n_rules: int = 4
    noise: float = 0.05

    def __post_init__(self) -> None:
        check_fields(self, "SyntheticDataConfig.", {"vocab_size": ">= 1", "seed": ">= 0", "n_rules": ">= 1",
                                                    "noise": "[0, 1]"})


@dataclasses.dataclass(frozen=True)
class InitFrom:
    """Start a run from a committed checkpoint of another training step instead of a fresh state.

    ``run``: the source step's output directory (``output_path_of(source_step)`` in an experiment
    file, so the source's version is part of this step's). ``step``: the checkpoint's step (it must
    be committed; retention keeps it when it is a multiple of the source's ``keep_every_steps``).
    ``optimizer``: also take the optimizer's state (else a fresh one; a source trained with another
    optimizer needs ``optimizer=False``). ``data_position``: continue the source's data stream and
    step counter (the batch at step N is the source's batch N, the LR schedule is read at N): what a
    cooldown side branch or a longer horizon wants; without it the run starts at its own step 0 with
    the source's weights.

    Used only when the run has no checkpoint of its own: a branch that was interrupted resumes from
    its own checkpoints, like any run.
    """

    run: str = input_field()
    step: int
    optimizer: bool = True
    data_position: bool = True

    def __post_init__(self) -> None:
        check_fields(self, "init_from.", {"step": "> 0"})  # a committed checkpoint: step 0 is never saved


@dataclasses.dataclass(frozen=True)
class Cutover:
    """A change of a live run and the gate it rests on: from ``step`` on the run applies what candidate
    ``candidate`` of the gate at ``gate`` (the gate step's output directory, whose ``gate.json`` holds
    the verdict) tested, e.g. a transport switch at that step. The run refuses to start when that
    verdict failed or is missing, unless ``forced`` (which the record then keeps)."""

    step: int
    gate: str
    candidate: str
    forced: bool = False

    def __post_init__(self) -> None:
        check_fields(self, "Cutover.", {"step": "> 0"})  # a change of a live run: step 0 is its start


def resolve_model(
    model: MoEConfig | str,
    overrides: dict[str, Any] | None = None,
    seq_len_phases: tuple[tuple[float, int], ...] = (),
) -> MoEConfig:
    """The model a run trains: ``model`` (a preset name or a :class:`MoEConfig`) with ``overrides``,
    and ``max_seq_len`` raised to the longest sequence phase. Resolved once, when the config is
    built, so the version of a step names the model itself rather than a preset name whose meaning
    can change."""
    overrides = dict(overrides or {})
    if isinstance(model, MoEConfig):
        cfg = model.replace(**overrides) if overrides else model
    elif isinstance(model, str):
        cfg = get_preset(model, **overrides)
    else:
        raise TypeError(f"model must be a preset name or a MoEConfig, got {type(model).__name__}")
    longest = max((int(n) for _, n in seq_len_phases), default=0)
    return cfg.replace(max_seq_len=longest) if cfg.max_seq_len < longest else cfg


EVAL_IS_TELEMETRY = "in-training evaluation is telemetry: it reads the weights, never writes them"


def _pairs(value: Any, kinds: tuple[type, type], name: str = "a schedule") -> Any:
    """One spelling of a schedule given as pairs (the version encodes it): a tuple of typed tuples;
    anything else is refused in one line naming the field ``name``."""
    if isinstance(value, (VersionedValue, InputName)):
        return value
    try:
        if isinstance(value, (list, tuple)):
            out = tuple((kinds[0](a), kinds[1](b)) for a, b in value)
            if all(isinstance(a, numbers.Real) and isinstance(b, (numbers.Real, str)) for a, b in value):
                return out
    except (TypeError, ValueError):
        pass
    kinds_text = ", ".join(k.__name__ for k in kinds)
    raise FieldError(f"{name} must be a tuple of ({kinds_text}) pairs, got {value!r}")


# --- the groups of a TrainConfig, one per concept ---------------------------------------------------
# Each is versioned field by field by its own rule; in a step's hash its fields are named as
# TrainConfig's own (peak_lr, not optimizer.peak_lr: marin.execution.versioning.group), so the
# hashes of runs declared before TrainConfig was grouped did not move. evaluation is the exception:
# every field is live, and its sets' and tasks' upstream steps are named by their path.


@dataclasses.dataclass(frozen=True)
class TrainEvalConfig:
    """Evaluation during training: every ``every_steps`` steps and at the last step, bits per byte on
    ``sets`` (:class:`marin.evaluation.sets.EvalSet`) plus, when ``held_out`` and the data is a
    mixture, its held-out split, and the multiple-choice ``tasks``, as records with kind ``"eval"``
    in ``metrics.jsonl``. ``every_steps=None``: no evaluation."""

    every_steps: int | None = live(EVAL_IS_TELEMETRY, default=None)
    sets: tuple[Any, ...] = live(
        "in-training evaluation is telemetry (the sets' tokenize steps are dependencies, which are versioned, "
        "and so are the names default_eval_suite marks)", default=())
    held_out: bool = live(EVAL_IS_TELEMETRY, default=True)
    tasks: dict[str, str] = live(
        "in-training evaluation is telemetry (a task written by a step is a dependency, which is versioned)",
        default_factory=dict)
    """Multiple-choice tasks, name -> jsonl path (marin.evaluation.multiple_choice), scored at each
    in-training eval as the eval step scores them; their accuracy, byte-normalised accuracy and task
    loss go into the eval records as ``eval/task/{name}/acc``, ``.../acc_norm`` and ``.../gold_bpb``."""
    stride: int | None = live(EVAL_IS_TELEMETRY, default=None)

    def __post_init__(self) -> None:
        if isinstance(self.sets, list):
            object.__setattr__(self, "sets", tuple(self.sets))
        check_fields(self, "evaluation.", {"every_steps": "> 0", "stride": "> 0"})
        if self.tasks and self.every_steps is None:
            raise ValueError(f"evaluation.tasks {sorted(self.tasks)} are scored by the in-training eval, which "
                             "evaluation.every_steps=None turns off; set evaluation.every_steps")


@dataclasses.dataclass(frozen=True)
class TelemetryConfig:
    """What the run reports and where: ``metrics.jsonl`` every ``log_every`` steps, W&B under
    ``wandb_project`` (None: off) as ``run_name``, a progress line every ``progress_every_s``."""

    log_every: int = live("telemetry only", default=1)
    wandb_project: str | None = live("telemetry only", default="marin")
    run_name: str | None = live("telemetry only", default=None)
    progress_every_s: float = live("telemetry only", default=10.0)

    def __post_init__(self) -> None:
        check_fields(self, "telemetry.", {"log_every": ">= 1", "progress_every_s": ">= 0"})


@dataclasses.dataclass(frozen=True)
class ParallelismConfig:
    """How the work is spread over the pool's devices: none of it changes what is computed beyond
    float summation order (and the capacity-bounded transports' dropped tokens), so every field is
    live and a run resumes into another layout from its checkpoints."""

    microbatches: int | None = live(
        "gradient accumulation count (None: the smallest the memory planner says fits); it changes only the "
        "float summation order", default=None)
    param_sharding: str = live(
        "where weights, gradients and AdamW moments live (replicated or fsdp): the same math, only where partial "
        "sums are added changes (float reassociation, within 2e-5 on the loss in the tests); a checkpoint "
        "restores onto any layout and mesh, so a run resumes into either", default="replicated")
    remat_by_seq_len: tuple[tuple[int, str], ...] = live(
        "the remat policy of some sequence-length phases, overriding the model's (((65536, 'full'),)): "
        "recomputation changes memory and speed, not what is computed (the same losses at rel 1e-5 in the tests)",
        default=())
    context_parallel_by_seq_len: tuple[tuple[int, int], ...] = live(
        "(seq_len, C): split each sequence of that phase over C devices of the expert axis "
        "(marin.models.context_parallel), ((262144, 4),): how the work is spread, not what is computed (the "
        "same losses within float summation order in the tests); a phase not listed: one device per sequence",
        default=())
    transport_switches: tuple[tuple[int, str], ...] = live(
        "EP transport by step, e.g. ((0, 'fixed'), (81716, 'ragged_capacity')): a throughput decision taken on a "
        "live run; the transports compute the same model, except that capacity-bounded buffers drop the tokens "
        "that overflow them (logged as drop_frac_send / drop_frac_recv), so a switch changes the weights slightly "
        "but must not restart the run", default=())
    grouped_impl: str = live(
        "the routed experts' grouped compute (auto, capacity, ragged_dot, tokamax; auto: the platform's rule, "
        "docs/model.md): every implementation computes the same SwiGLU of the same rows, so it changes only the "
        "float summation order, never the model; an operator may change it on a live run after a gate, as kernel "
        "settings are changed", default="auto")

    def __post_init__(self) -> None:
        for name, kinds in (("remat_by_seq_len", (int, str)), ("context_parallel_by_seq_len", (int, int)),
                            ("transport_switches", (int, str))):
            object.__setattr__(self, name, _pairs(getattr(self, name), kinds, f"parallelism.{name}"))
        check_fields(self, "parallelism.", {"microbatches": ">= 1"})  # None: the planner's
        for name in ("remat_by_seq_len", "context_parallel_by_seq_len"):
            for i, (seq_len, _) in enumerate(getattr(self, name)):
                check_number(f"parallelism.{name}[{i}] sequence length", seq_len, int, ">= 1")
        for i, (_, degree) in enumerate(self.context_parallel_by_seq_len):
            check_number(f"parallelism.context_parallel_by_seq_len[{i}] degree", degree, int, ">= 1")
        if self.transport_switches:
            unknown = [t for _, t in self.transport_switches if t not in TRANSPORTS]
            if unknown:
                raise FieldError(f"parallelism.transport_switches: unknown transport {unknown[0]!r}; choose from "
                                 f"{', '.join(TRANSPORTS)}")
            try:
                self.transport_schedule(self.transport_switches[0][1])
            except ValueError as e:
                raise FieldError(f"parallelism.transport_switches {self.transport_switches}: {e}") from None
        if self.param_sharding not in PARAM_SHARDINGS:
            raise ValueError(f"unknown param_sharding {self.param_sharding!r}; choose from {PARAM_SHARDINGS}")
        for _, policy in self.remat_by_seq_len:
            if policy not in REMAT_POLICIES:
                raise ValueError(f"remat_by_seq_len: unknown remat policy {policy!r}; choose from {REMAT_POLICIES}")
        try:
            object.__setattr__(self, "grouped_impl", canonical_grouped_impl(self.grouped_impl))
        except ValueError as e:
            raise ValueError(f"parallelism.{e}") from None

    def transport_schedule(self, default: str) -> TransportSchedule:
        """The EP transport by step (``default`` throughout when no switch is set)."""
        if not self.transport_switches:
            return TransportSchedule.constant(default)
        return TransportSchedule(tuple((int(s), str(t)) for s, t in self.transport_switches))


GROUPS: dict[str, type] = {"optimizer": OptimizerBase, "checkpoint": CheckpointPolicy, "stall": StallRule,
                           "evaluation": TrainEvalConfig, "telemetry": TelemetryConfig,
                           "parallelism": ParallelismConfig}
"""TrainConfig's groups: field name -> class (the optimizer: any registered one,
:data:`marin.training.optimizers.OPTIMIZERS`)."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run.

    ``data`` is a ``marin.data.mixture.MixtureConfig`` for real runs (the trainer reads it with
    ``MixtureLoader``) or a :class:`SyntheticDataConfig`. ``model`` is the :class:`MoEConfig` the run
    trains (its ``max_seq_len`` raised to the longest sequence phase, see :func:`resolve_model`); a
    preset name is accepted too and resolved at construction, after which ``preset`` keeps the name
    for readability. ``train_steps`` is the original horizon; ``optimizer.lr_replans`` moves it later on.
    The rest is grouped by concept, each group a dataclass with its own defaults and checks:
    ``optimizer`` (AdamW or MuonH, and the LR schedule), ``checkpoint`` (when state is saved and kept),
    ``stall`` (the pool launcher's watchdog), ``evaluation`` (in training), ``telemetry`` and
    ``parallelism`` (how the work is spread).
    """

    output_path: str = input_field()
    data: Any = dataclasses.field()
    """A ``MixtureConfig`` (versioned field by field, its stores through their tokenize steps' hashes)
    or a ``SyntheticDataConfig`` (one versioned value)."""
    model: MoEConfig | str = by_field("every resolved MoEConfig field is its own leaf (model.n_layers), so "
                                      "editing a preset moves the hash and marin explain names the field",
                                      default="tiny-ep")
    pool: PoolSpec = live("where the run executes, not what it computes: a run may move to another pool and "
                          "resume from its checkpoints", default="local-cpu")
    """The pool itself, whole (a name given here, one of marin.pools.POOLS or of a pools file, is resolved to its
    PoolSpec when the config is built; the run's records hold the spec, so no other process looks the name up)."""
    seed: int = 0
    # horizon and batch
    train_steps: int = 100
    """The horizon as planned (``optimizer.lr_replans`` moves it later on)."""
    tokens_per_step: int = 4096
    seq_len_phases: tuple[tuple[float, int], ...] = ((0.0, 64),)
    preset: str | None = None
    """The preset ``model`` was resolved from (readability: ``model``, versioned field by field, is what is trained)."""
    init_from: InitFrom | None = by_field(
        "a branch's source: the source run's output (a placeholder: versioned through its hash), the checkpoint "
        "step and what is taken from it are versioned; None (a fresh start) adds nothing", default=None)
    optimizer: OptimizerBase = group(
        "the optimizer (AdamW or MuonH, marin.training.optimizers) and the LR schedule: versioned field by field "
        "(lr_replans is live); AdamW's fields keep their names, so runs declared before MuonH keep their hashes",
        default_factory=AdamWConfig)
    checkpoint: CheckpointPolicy = group("when state is saved and kept: every field live",
                                         default_factory=CheckpointPolicy)
    stall: StallRule = group("the pool launcher's stall watchdog (marin.pools.stall): every field live",
                             default_factory=StallRule)
    evaluation: TrainEvalConfig = by_field(
        "evaluation during training: every field live (telemetry); the sets' and tasks' upstream steps are "
        "versioned dependencies, named by their path (evaluation.sets[0].store)", default_factory=TrainEvalConfig)
    telemetry: TelemetryConfig = group("metrics, W&B and progress lines: every field live",
                                       default_factory=TelemetryConfig)
    parallelism: ParallelismConfig = group("how the work is spread over the devices: every field live",
                                           default_factory=ParallelismConfig)
    cutovers: tuple[Cutover, ...] = live(
        "the gates the run's live changes rest on (marin.training.gate): evidence for a decision, not what is "
        "computed", default=())

    def __post_init__(self) -> None:
        check_fields(self, "", {"seed": ">= 0", "train_steps": "> 0", "tokens_per_step": "> 0"})
        # one spelling of the schedule, whatever sequence the caller passed (the version encodes it)
        object.__setattr__(self, "seq_len_phases", _pairs(self.seq_len_phases, (float, int), "seq_len_phases"))
        object.__setattr__(self, "pool", as_pool(self.pool))  # resolved once, here: the spec travels
        object.__setattr__(self, "cutovers", tuple(Cutover(**c) if isinstance(c, dict) else c for c in self.cutovers))
        object.__setattr__(self, "optimizer", optimizer_from(self.optimizer))  # a dict: its kind picks the class
        for name, cls in GROUPS.items():
            if name == "optimizer":  # any optimizer (the union), checked just above
                continue
            value = getattr(self, name)
            if isinstance(value, dict):  # a group spelled as a dict (a parsed command line, a record)
                object.__setattr__(self, name, cls(**value))
            elif not isinstance(value, cls):
                raise TypeError(f"TrainConfig.{name} must be a {cls.__name__}, got {type(value).__name__}")
        order = getattr(self.data, "order", None)
        if isinstance(self.data, MixtureConfig) and getattr(order, "value", order) == WITHOUT_REPLACEMENT_V1:
            block_length([n for _, n in self.seq_len_phases])  # refuses phases it cannot keep aligned, in one line
        if self.evaluation.tasks and isinstance(self.data, SyntheticDataConfig):
            raise ValueError("evaluation.tasks need a run on tokenized text; synthetic tokens have no tokenizer")
        if self.checkpoint.temp_every_minutes is not None and not self.checkpoint.temp_path:
            raise ValueError("checkpoint.temp_every_minutes needs checkpoint.temp_path (a fast local or region-local "
                             "prefix for the temporary checkpoint)")
        if isinstance(self.model, str):
            object.__setattr__(self, "preset", self.preset or self.model)
        elif not isinstance(self.model, MoEConfig):
            raise TypeError(f"TrainConfig.model must be a preset name or a MoEConfig, got {type(self.model).__name__}")
        # the longest phase fits the model, whether it came as a preset name or a MoEConfig
        object.__setattr__(self, "model", resolve_model(self.model, seq_len_phases=tuple(self.seq_len_phases)))
        self._check_schedules()
        self._check_branch()

    def _check_schedules(self) -> None:
        """The schedules the trainer builds from these fields, built here, so a bad one is refused where
        the config is built (the experiment file's line), one line naming the field, not after the pool
        started: the sequence-length phases (from 0, in order, inside the run, each dividing the batch),
        the LR schedule (warmup inside the horizon, re-plans in order after warmup)."""
        try:
            self.seq_len_schedule()
        except ValueError as e:
            raise FieldError(f"seq_len_phases {self.seq_len_phases}: {e}") from None
        if self.optimizer.warmup_steps > self.train_steps:
            raise FieldError(f"optimizer.warmup_steps ({self.optimizer.warmup_steps}) must be at most train_steps "
                             f"({self.train_steps}): the warmup is part of the horizon")
        try:
            self.lr_schedule()
        except ValueError as e:
            raise FieldError(f"optimizer.lr_replans {self.optimizer.lr_replans}: {e}") from None

    def _check_branch(self) -> None:
        """A branch that takes its source's optimizer state (``init_from.optimizer``) needs the source's
        optimizer: checked here when the source is a declared step (``branch_from(step, ...)``), so the
        dry run refuses it; a source given as a path is checked by the trainer against its checkpoint."""
        src = self.init_from
        if src is None or not src.optimizer or not isinstance(src.run, InputName):
            return
        source = src.run.step
        optimizer = getattr(source.config, "optimizer", None) if isinstance(source, ExecutorStep) else None
        kind = getattr(optimizer, "kind", None)
        kind = kind.value if isinstance(kind, VersionedValue) else kind
        if isinstance(kind, str) and kind != self.optimizer.kind:
            raise FieldError(f"init_from: {source.name} trains with {kind} but this run with {self.optimizer.kind}, "
                             "and a branch that takes the optimizer state needs the same optimizer: "
                             "branch_from(..., optimizer=False) starts a fresh one")

    def lr_schedule(self) -> LRSchedule:
        return self.optimizer.lr_schedule(self.train_steps)

    @property
    def total_steps(self) -> int:
        """The horizon in force after all re-plans: the run stops here."""
        return self.lr_schedule().final_total_steps

    def seq_len_schedule(self) -> SeqLenSchedule:
        return SeqLenSchedule(
            self.tokens_per_step, tuple(SeqLenPhase(float(f), int(n)) for f, n in self.seq_len_phases)
        )

    def transport_schedule(self, default: str) -> TransportSchedule:
        return self.parallelism.transport_schedule(default)


def model_at(config: TrainConfig, cfg: MoEConfig, seq_len: int) -> MoEConfig:
    """The model one sequence-length phase runs: ``cfg`` with the phase's remat policy and context
    parallelism, if the run sets them (``parallelism.remat_by_seq_len``, ``.context_parallel_by_seq_len``); the
    trainer and the memory planner both ask here."""
    policy = dict((int(n), p) for n, p in config.parallelism.remat_by_seq_len).get(int(seq_len))
    if policy and policy != cfg.remat_policy:
        cfg = dataclasses.replace(cfg, remat_policy=policy)
    cp = context_parallel_at(config, seq_len)
    return dataclasses.replace(cfg, context_parallel=cp) if cp != cfg.context_parallel else cfg


def context_parallel_at(config: TrainConfig, seq_len: int) -> int:
    """The context-parallel degree of one sequence-length phase (1: one device per sequence)."""
    return int(dict((int(n), int(c)) for n, c in config.parallelism.context_parallel_by_seq_len).get(int(seq_len), 1))


def train_config_from_record(record: dict[str, Any]) -> TrainConfig:
    """The :class:`TrainConfig` a run recorded (a checkpoint's config record, or the step's), every
    field read back by the one generic reader (:func:`marin.execution.jsonable.from_jsonable`), so
    a field added to the config comes back without a change here. Masked secrets read back as
    ``***``; fields the config no longer has are skipped. ValueError naming the field otherwise."""
    types = {"data": MixtureConfig | SyntheticDataConfig, "evaluation.sets": tuple[EvalSet, ...],
             "optimizer": optimizer_type()}  # any registered optimizer
    return from_jsonable(TrainConfig, record, types=types, ignore_unknown=True)
