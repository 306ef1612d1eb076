"""The training step's configuration (JAX-free, so experiment files and the CLI import it cheaply).

A :class:`TrainConfig` is what ``default_train`` puts into the executor step; everything the run needs
is in it. Every field is part of the run's version unless it is declared live below, with why
(:mod:`marin.execution.versioning`): what an operator may change on a running run (the pool, horizon
re-plans, the transport switch, checkpoint cadence, telemetry) keeps its output path, so the step
resumes from its checkpoints. The model is carried fully resolved
(every :class:`~marin.models.config.MoEConfig` field after preset, overrides and compute dtype), so
editing a preset changes the version of every run that uses it; the trainer builds exactly that model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from marin.data.mixture import MixtureConfig
from marin.execution.jsonable import from_jsonable
from marin.execution.versioning import by_field, input_field, live
from marin.models.config import REMAT_POLICIES, MoEConfig, get_preset
from marin.parallel.layout import PARAM_SHARDINGS
from marin.training.checkpoint.manager import CheckpointPolicy
from marin.training.schedule import (
    DEFAULT_FINAL_LR_FRACTION,
    LRSchedule,
    Replan,
    SeqLenPhase,
    SeqLenSchedule,
    TransportSchedule,
)
from marin.training.stall import StallRule


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


@dataclasses.dataclass(frozen=True)
class InitFrom:
    """Start a run from a committed checkpoint of another training step instead of a fresh state.

    ``run``: the source step's output directory (``output_path_of(source_step)`` in an experiment
    file, so the source's version is part of this step's). ``step``: the checkpoint's step (it must
    be committed; retention keeps it when it is a multiple of the source's ``keep_every_steps``).
    ``optimizer``: also take the AdamW state (else fresh moments). ``data_position``: continue the
    source's data stream and step counter (the batch at step N is the source's batch N, the LR
    schedule is read at N): what a cooldown side branch or a longer horizon wants; without it the
    run starts at its own step 0 with the source's weights.

    Used only when the run has no checkpoint of its own: a branch that was interrupted resumes from
    its own checkpoints, like any run.
    """

    run: str = input_field()
    step: int
    optimizer: bool = True
    data_position: bool = True


def resolve_model(
    preset: str,
    overrides: dict[str, Any] | None = None,
    compute_dtype: str | None = None,
    seq_len_phases: tuple[tuple[float, int], ...] = (),
) -> MoEConfig:
    """The model a run trains: ``preset`` + ``overrides`` (+ ``compute_dtype``), with ``max_seq_len``
    raised to the longest sequence phase. Resolved once, when the config is built, so the version of a
    step names the model itself rather than a preset name whose meaning can change."""
    overrides = dict(overrides or {})
    if compute_dtype is not None:
        overrides["dtype"] = compute_dtype
    cfg = get_preset(preset, **overrides)
    longest = max((int(n) for _, n in seq_len_phases), default=0)
    return cfg.replace(max_seq_len=longest) if cfg.max_seq_len < longest else cfg


EVAL_IS_TELEMETRY = "in-training evaluation is telemetry: it reads the weights, never writes them"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run.

    ``data`` is a ``marin.data.mixture.MixtureConfig`` for real runs (the trainer reads it with
    ``MixtureLoader``) or a :class:`SyntheticDataConfig`. ``model`` is the resolved
    :class:`MoEConfig` the run trains; a preset name is accepted too and resolved at construction
    (with ``model_overrides`` and ``compute_dtype`` applied, see :func:`resolve_model`), after which
    ``preset`` keeps the name for readability. ``train_steps`` is the original horizon;
    ``lr_replans`` moves it later on.
    """

    output_path: str = input_field()
    data: Any = dataclasses.field()
    """A ``MixtureConfig`` (versioned field by field, its stores through their tokenize steps' hashes)
    or a ``SyntheticDataConfig`` (one versioned value)."""
    model: MoEConfig | str = by_field("every resolved MoEConfig field is its own leaf (model.n_layers), so "
                                      "editing a preset moves the hash and marin explain names the field",
                                      default="tiny-ep")
    model_overrides: dict[str, Any] = live("applied to model when the config is built; model is versioned",
                                           default_factory=dict)
    pool: str = live("where the run executes, not what it computes: a run may move to another pool and resume "
                     "from its checkpoints", default="local-cpu")
    seed: int = 0
    # horizon and batch
    train_steps: int = 100
    """The horizon as planned (``lr_replans`` moves it later on)."""
    tokens_per_step: int = 4096
    microbatches: int | None = live(
        "gradient accumulation count (None: the smallest the memory planner says fits); it changes only the "
        "float summation order", default=None)
    seq_len_phases: tuple[tuple[float, int], ...] = ((0.0, 64),)
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
    # optimizer (AdamW with global-norm clipping)
    peak_lr: float = 3e-3
    warmup_steps: int = 10
    final_lr_fraction: float = DEFAULT_FINAL_LR_FRACTION
    lr_replans: tuple[tuple[int, int], ...] = live(
        "(at_step, new_total_steps): moving the horizon of a running run; the schedule before the re-plan point "
        "is unchanged and the run resumes from its checkpoints", default=())
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    compute_dtype: str | None = live(
        "applied to model when the config is built ('bfloat16': bf16 compute, float32 master weights); "
        "model.dtype is versioned", default=None)
    transport_switches: tuple[tuple[int, str], ...] = live(
        "EP transport by step, e.g. ((0, 'fixed'), (81716, 'ragged_capacity')): a throughput decision taken on a "
        "live run; the transports compute the same model, except that capacity-bounded buffers drop the tokens "
        "that overflow them (logged as drop_frac_send / drop_frac_recv), so a switch changes the weights slightly "
        "but must not restart the run", default=())
    # checkpoints
    checkpoint_every_steps: int = live("when state is saved, not what is computed", default=100)
    checkpoint_every_minutes: float | None = live("when state is saved, not what is computed", default=30.0)
    keep_last_checkpoints: int = live("which checkpoints are kept, not what is computed", default=2)
    keep_every_steps: int | None = live("which checkpoints are kept, not what is computed", default=None)
    # the second tier: a rolling temporary checkpoint on fast storage, beside the permanent ones above
    temp_checkpoint_every_minutes: float | None = live(
        "when state is saved, not what is computed: a rolling temporary checkpoint every this many minutes of "
        "wall time (None: none), so a fault costs at most this long while permanent checkpoints stay sparse",
        default=None)
    temp_checkpoint_path: str | None = live(
        "where the temporary checkpoint goes (a fast local or region-local prefix; the run writes under "
        "<prefix>/<run directory name>-<hash of its output path>/checkpoints, one kept), not what is computed: "
        "a run may move to another region and resume from its permanent checkpoints", default=None)
    # the stall watchdog of the pool launcher (marin.training.stall)
    stall_timeout_s: float | None = live(
        "when a hung pool is killed and relaunched from its last checkpoint, not what is computed; an operator "
        "tunes it on a live run. None: 10 x the median measured step time, at least 600 s", default=None)
    stall_startup_s: float = live(
        "the stall watchdog's allowance before the first step of an attempt (checkpoint restore, compilation) "
        "and during a new phase's compilation, an in-training eval or a checkpoint wait; not what is computed",
        default=3600.0)
    preemption_grace_s: float = live(
        "seconds between the scheduler's SIGTERM and its SIGKILL (Kubernetes: terminationGracePeriodSeconds); "
        "> 0: a SIGTERM ends training at the next step with a final checkpoint where the grace allows "
        "(marin.training.preemption); 0 leaves SIGTERM alone (tiny runs). When state is saved, not what is "
        "computed", default=0.0)
    # telemetry
    log_every: int = live("telemetry only", default=1)
    wandb_project: str | None = live("telemetry only", default="marin")
    run_name: str | None = live("telemetry only", default=None)
    progress_every_s: float = live("telemetry only", default=10.0)
    # evaluation during training: every eval_every_steps steps and at the last step, bits per byte on
    # eval_sets (marin.evaluation.sets.EvalSet) plus, when eval_held_out and the data is a mixture, its
    # held-out split, and the multiple-choice eval_tasks, as records with kind "eval" in metrics.jsonl.
    # None: no evaluation.
    eval_every_steps: int | None = live(EVAL_IS_TELEMETRY, default=None)
    eval_sets: tuple[Any, ...] = live(
        "in-training evaluation is telemetry (the sets' tokenize steps are dependencies, which are versioned, "
        "and so are the names default_eval_suite marks)", default=())
    eval_held_out: bool = live(EVAL_IS_TELEMETRY, default=True)
    eval_tasks: dict[str, str] = live(
        "in-training evaluation is telemetry (a task written by a step is a dependency, which is versioned)",
        default_factory=dict)
    """Multiple-choice tasks, name -> jsonl path (marin.evaluation.multiple_choice), scored at each
    in-training eval as the eval step scores them; their accuracy, byte-normalised accuracy and task
    loss go into the eval records as ``eval/task/{name}/acc``, ``.../acc_norm`` and ``.../gold_bpb``."""
    eval_stride: int | None = live(EVAL_IS_TELEMETRY, default=None)
    preset: str | None = None
    """The preset ``model`` was resolved from (readability: ``model``, versioned field by field, is what is trained)."""
    init_from: InitFrom | None = by_field(
        "a branch's source: the source run's output (a placeholder: versioned through its hash), the checkpoint "
        "step and what is taken from it are versioned; None (a fresh start) adds nothing", default=None)

    def __post_init__(self) -> None:
        # one spelling of the schedules, whatever sequences the caller passed (the version encodes them)
        for name, kinds in (("seq_len_phases", (float, int)), ("transport_switches", (int, str)),
                            ("remat_by_seq_len", (int, str)), ("lr_replans", (int, int)),
                            ("context_parallel_by_seq_len", (int, int))):
            value = getattr(self, name)
            if isinstance(value, (list, tuple)):
                object.__setattr__(self, name, tuple((kinds[0](a), kinds[1](b)) for a, b in value))
        if isinstance(self.eval_sets, list):
            object.__setattr__(self, "eval_sets", tuple(self.eval_sets))
        if self.eval_tasks and self.eval_every_steps is None:
            raise ValueError(f"eval_tasks {sorted(self.eval_tasks)} are scored by the in-training eval, which "
                             "eval_every_steps=None turns off; set eval_every_steps")
        if self.eval_tasks and isinstance(self.data, SyntheticDataConfig):
            raise ValueError("eval_tasks need a run on tokenized text; synthetic tokens have no tokenizer")
        if self.temp_checkpoint_every_minutes is not None and not self.temp_checkpoint_path:
            raise ValueError("temp_checkpoint_every_minutes needs temp_checkpoint_path (a fast local or region-local "
                             "prefix for the temporary checkpoint)")
        if self.param_sharding not in PARAM_SHARDINGS:
            raise ValueError(f"unknown param_sharding {self.param_sharding!r}; choose from {PARAM_SHARDINGS}")
        for _, policy in self.remat_by_seq_len:
            if policy not in REMAT_POLICIES:
                raise ValueError(f"remat_by_seq_len: unknown remat policy {policy!r}; choose from {REMAT_POLICIES}")
        if isinstance(self.model, str):
            object.__setattr__(self, "preset", self.preset or self.model)
            object.__setattr__(self, "model", resolve_model(self.model, self.model_overrides, self.compute_dtype,
                                                            tuple(self.seq_len_phases)))
        elif self.model_overrides or self.compute_dtype is not None:
            # e.g. dataclasses.replace(config, model_overrides=...) on a resolved config: never ignore it
            wanted = dict(self.model_overrides)
            if self.compute_dtype is not None:
                wanted["dtype"] = self.compute_dtype
            differ = {k: v for k, v in wanted.items() if getattr(self.model, k, v) != v}
            if differ:
                raise ValueError(
                    f"model_overrides/compute_dtype {differ} disagree with the resolved model; the model is "
                    "resolved once, so pass model=<preset name> (or a MoEConfig with these values) to change it"
                )

    def lr_schedule(self) -> LRSchedule:
        return LRSchedule(
            peak_lr=self.peak_lr,
            warmup_steps=self.warmup_steps,
            total_steps=self.train_steps,
            final_fraction=self.final_lr_fraction,
            replans=tuple(Replan(int(a), int(t)) for a, t in self.lr_replans),
        )

    @property
    def total_steps(self) -> int:
        """The horizon in force after all re-plans: the run stops here."""
        return self.lr_schedule().final_total_steps

    def seq_len_schedule(self) -> SeqLenSchedule:
        return SeqLenSchedule(
            self.tokens_per_step, tuple(SeqLenPhase(float(f), int(n)) for f, n in self.seq_len_phases)
        )

    def transport_schedule(self, default: str) -> TransportSchedule:
        if not self.transport_switches:
            return TransportSchedule.constant(default)
        return TransportSchedule(tuple((int(s), str(t)) for s, t in self.transport_switches))

    def checkpoint_policy(self) -> CheckpointPolicy:
        return CheckpointPolicy(
            every_steps=self.checkpoint_every_steps,
            every_minutes=self.checkpoint_every_minutes,
            keep_last=self.keep_last_checkpoints,
            keep_every=self.keep_every_steps,
            temp_every_minutes=self.temp_checkpoint_every_minutes,
        )

    def stall_rule(self) -> StallRule:
        """When the pool launcher counts this run's pool as hung (marin.training.stall)."""
        return StallRule(timeout_s=self.stall_timeout_s, startup_s=self.stall_startup_s)


def model_at(config: TrainConfig, cfg: MoEConfig, seq_len: int) -> MoEConfig:
    """The model one sequence-length phase runs: ``cfg`` with the phase's remat policy and context
    parallelism, if the run sets them (``remat_by_seq_len``, ``context_parallel_by_seq_len``); the
    trainer and the memory planner both ask here."""
    policy = dict((int(n), p) for n, p in config.remat_by_seq_len).get(int(seq_len))
    if policy and policy != cfg.remat_policy:
        cfg = dataclasses.replace(cfg, remat_policy=policy)
    cp = context_parallel_at(config, seq_len)
    return dataclasses.replace(cfg, context_parallel=cp) if cp != cfg.context_parallel else cfg


def context_parallel_at(config: TrainConfig, seq_len: int) -> int:
    """The context-parallel degree of one sequence-length phase (1: one device per sequence)."""
    return int(dict((int(n), int(c)) for n, c in config.context_parallel_by_seq_len).get(int(seq_len), 1))


def train_config_from_record(record: dict[str, Any]) -> TrainConfig:
    """The :class:`TrainConfig` a run recorded (a checkpoint's config record, or the step's), every
    field read back by the one generic reader (:func:`marin.execution.jsonable.from_jsonable`), so
    a field added to the config comes back without a change here. Masked secrets read back as
    ``***``; fields the config no longer has are skipped. ValueError naming the field otherwise."""
    # the eval sets' reader brings the tokenizer stack: only once a run's record is read
    from marin.evaluation.sets import EvalSet

    types = {"data": MixtureConfig | SyntheticDataConfig, "eval_sets": tuple[EvalSet, ...]}
    return from_jsonable(TrainConfig, train_record_in_current_spelling(record), types=types, ignore_unknown=True)


def train_record_in_current_spelling(record: dict[str, Any]) -> dict[str, Any]:
    """A recorded TrainConfig in today's field names. Records and TrainConfig spell their fields
    alike today, so it is the record itself; where a field moves (into a nested group), records
    written before still read through the function that accepts both spellings, called here."""
    return record
