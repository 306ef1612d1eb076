"""The training step's configuration (JAX-free, so experiment files and the CLI import it cheaply).

A :class:`TrainConfig` is what ``default_train`` puts into the executor step; everything the run needs
is in it. Fields that are part of the run's identity are wrapped in ``versioned`` by the experiment
layer; the horizon re-plans (``lr_replans``) deliberately are not, so that re-planning a running
step keeps its output path and resumes from its checkpoints. The model is carried fully resolved
(every :class:`~marin.models.config.MoEConfig` field after preset, overrides and compute dtype), so
editing a preset changes the version of every run that uses it; the trainer builds exactly that model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from marin.models.config import REMAT_POLICIES, MoEConfig, get_preset
from marin.parallel.layout import PARAM_SHARDINGS
from marin.training.checkpoint import CheckpointPolicy
from marin.training.schedule import (
    DEFAULT_FINAL_LR_FRACTION,
    LRSchedule,
    Replan,
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

    run: str
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

    output_path: str
    data: Any
    model: MoEConfig | str = "tiny-ep"
    model_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    pool: str = "local-cpu"
    seed: int = 0
    # horizon and batch
    train_steps: int = 100
    tokens_per_step: int = 4096
    # gradient accumulation: the optimizer batch (tokens_per_step) is computed in this many sequential
    # microbatches to fit device memory; None = the smallest count the memory planner says fits.
    # Not part of a run's identity: it changes only float summation order.
    microbatches: int | None = None
    seq_len_phases: tuple[tuple[float, int], ...] = ((0.0, 64),)
    # where the weights and their AdamW state live (marin.parallel.layout): "replicated" (routed
    # experts split over "expert", the rest a full copy per device) or "fsdp" (every weight matrix
    # split over the mesh, gathered per use). Not part of a run's identity: it changes the layout and
    # the float summation order only, and checkpoints hold whole arrays, so a run may switch on resume.
    param_sharding: str = "replicated"
    # remat policy by sequence length, overriding the model's for those phases: ((65536, "full"),)
    # recomputes every layer in the 65K phase only, where the model's policy would keep too much.
    # Not part of a run's identity: recomputation changes memory and speed, not what is computed.
    remat_by_seq_len: tuple[tuple[int, str], ...] = ()
    # optimizer (AdamW with global-norm clipping)
    peak_lr: float = 3e-3
    warmup_steps: int = 10
    final_lr_fraction: float = DEFAULT_FINAL_LR_FRACTION
    lr_replans: tuple[tuple[int, int], ...] = ()
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    # "bfloat16" computes in bf16 with float32 master weights; None keeps the preset's dtype
    compute_dtype: str | None = None
    # EP transport by step: ((0, "fixed"), (800, "dropless")); empty = the preset's transport
    transport_switches: tuple[tuple[int, str], ...] = ()
    # checkpoints
    checkpoint_every_steps: int = 100
    checkpoint_every_minutes: float | None = 30.0
    keep_last_checkpoints: int = 2
    keep_every_steps: int | None = None
    # telemetry
    log_every: int = 1
    wandb_project: str | None = "marin"
    run_name: str | None = None
    progress_every_s: float = 10.0
    # evaluation during training (telemetry, like the above: not part of the run's identity). Every
    # eval_every_steps steps and at the last step, bits per byte on eval_sets (marin.evaluation.sets.
    # EvalSet) plus, when eval_held_out and the data is a mixture, its held-out split, as records with
    # kind "eval" in metrics.jsonl. None: no evaluation.
    eval_every_steps: int | None = None
    eval_sets: tuple[Any, ...] = ()
    eval_held_out: bool = True
    eval_stride: int | None = None
    # the preset ``model`` was resolved from (readability only: ``model`` is what is trained)
    preset: str | None = None
    # branch from another run's checkpoint (InitFrom) instead of the seed's fresh state
    init_from: InitFrom | None = None

    def __post_init__(self) -> None:
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
        )


def model_at(config: TrainConfig, cfg: MoEConfig, seq_len: int) -> MoEConfig:
    """The model one sequence-length phase runs: ``cfg`` with the phase's remat policy, if the run
    sets one (``remat_by_seq_len``); the trainer and the memory planner both ask here."""
    policy = dict((int(n), p) for n, p in config.remat_by_seq_len).get(int(seq_len))
    return dataclasses.replace(cfg, remat_policy=policy) if policy and policy != cfg.remat_policy else cfg
