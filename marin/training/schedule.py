"""Pure schedules for a training run: learning rate, sequence length and EP transport.

Everything here is plain Python on integers and floats (no JAX): the trainer evaluates the schedules on
the host once per step and feeds the results into the compiled step as arguments. That keeps the
compiled step independent of the horizon, so a re-planned horizon (the published run's contingency: "shorten
the token horizon and re-plan the linear LR decay so that it still ends at 5% of peak") needs no
recompilation and no change to the checkpoint format.
"""

from __future__ import annotations

import dataclasses

from marin.runsteps import phase_start_step  # noqa: F401  (the schedules' rounding rule; re-exported)

# The hero recipe ends the linear decay at 5% of peak (the published schedule).
DEFAULT_FINAL_LR_FRACTION = 0.05


@dataclasses.dataclass(frozen=True)
class Replan:
    """From ``at_step`` on, decay linearly to the final LR at ``total_steps`` instead of the old end."""

    at_step: int
    total_steps: int


@dataclasses.dataclass(frozen=True)
class LRSchedule:
    """Linear warmup from 0 to ``peak_lr``, then linear decay to ``final_fraction * peak_lr``.

    ``replans`` holds horizon changes in the order they were decided. Each one starts a new straight
    segment from wherever the previous plan had the LR at ``at_step`` to the final LR at its own
    ``total_steps``, so the LR is continuous at every switch point and always ends at the same floor.
    """

    peak_lr: float
    warmup_steps: int
    total_steps: int
    final_fraction: float = DEFAULT_FINAL_LR_FRACTION
    replans: tuple[Replan, ...] = ()

    def __post_init__(self) -> None:
        if self.peak_lr <= 0:
            raise ValueError(f"peak_lr must be > 0, got {self.peak_lr}")
        if not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(f"need 0 <= warmup_steps ({self.warmup_steps}) <= total_steps ({self.total_steps})")
        if not 0 <= self.final_fraction <= 1:
            raise ValueError(f"final_fraction must be in [0, 1], got {self.final_fraction}")
        previous = 0
        for r in self.replans:
            if r.at_step < previous:
                raise ValueError(f"replans must be in step order; {r} comes after step {previous}")
            if r.total_steps <= r.at_step:
                raise ValueError(f"replan {r}: the new horizon must lie after the switch step")
            if r.at_step < self.warmup_steps:
                raise ValueError(f"replan {r}: re-plan the horizon after warmup ({self.warmup_steps} steps)")
            previous = r.at_step

    @property
    def final_total_steps(self) -> int:
        """The horizon in force at the end of the run (the last re-plan's, else the original)."""
        return self.replans[-1].total_steps if self.replans else self.total_steps

    def replanned(self, at_step: int, total_steps: int) -> LRSchedule:
        """This schedule with one more horizon change appended."""
        return dataclasses.replace(self, replans=self.replans + (Replan(at_step, total_steps),))


def schedule_from_config(config: dict) -> LRSchedule:
    """The LR schedule of a run from its recorded config (the step's status record or a checkpoint's
    metadata): peak, warmup, original horizon, final fraction and the re-plans already made."""
    opt = config["optimizer"]
    return LRSchedule(
        peak_lr=float(opt["peak_lr"]),
        warmup_steps=int(opt["warmup_steps"]),
        total_steps=int(config["train_steps"]),
        final_fraction=float(opt.get("final_lr_fraction", DEFAULT_FINAL_LR_FRACTION)),
        replans=tuple(Replan(int(a), int(t)) for a, t in opt.get("lr_replans", ())),
    )


def replan_horizon(schedule: LRSchedule, at_step: int, new_total: int, tokens_per_step: int = 0) -> dict:
    """The published contingency as data: the ``lr_replans`` value that moves the horizon to ``new_total``
    from ``at_step`` on (the LR still decays linearly to ``final_fraction`` of peak, now at the new
    horizon), the tokens it saves or adds, and a few LR values of the old and new plans to review."""
    new = schedule.replanned(at_step, new_total)
    probe = sorted({0, max(0, at_step - 1), at_step, at_step + 1, (at_step + new_total) // 2, new_total,
                    schedule.final_total_steps})
    return {
        "lr_replans": [[r.at_step, r.total_steps] for r in new.replans],
        "old_total_steps": schedule.final_total_steps,
        "new_total_steps": new_total,
        "tokens_saved_or_added": (new_total - schedule.final_total_steps) * int(tokens_per_step),
        "curve": [{"step": st, "old_lr": lr_at(st, schedule), "new_lr": lr_at(st, new)} for st in probe],
    }


def _base_lr(step: int, s: LRSchedule) -> float:
    """The original plan without re-plans."""
    final = s.final_fraction * s.peak_lr
    if step < s.warmup_steps:
        return s.peak_lr * (step + 1) / s.warmup_steps
    decay_steps = s.total_steps - s.warmup_steps
    if decay_steps <= 0:
        return final
    progress = min(1.0, (step - s.warmup_steps) / decay_steps)
    return s.peak_lr + (final - s.peak_lr) * progress


def _segment(r: Replan, start_lr: float, final: float, step: int) -> float:
    progress = min(1.0, (step - r.at_step) / (r.total_steps - r.at_step))
    return start_lr + (final - start_lr) * progress


def lr_at(step: int, schedule: LRSchedule) -> float:
    """Learning rate for optimizer step ``step`` (0-based) under ``schedule`` and its re-plans.

    Warmup uses ``(step + 1) / warmup`` so that step 0 already moves the weights; the decay reaches the
    floor exactly at the horizon and stays there if a run is continued past it. Each re-plan starts
    from the LR the previous plan gave at its switch step, so the curve never jumps.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    final = schedule.final_fraction * schedule.peak_lr
    active: Replan | None = None
    active_start = 0.0
    for r in schedule.replans:
        if step < r.at_step:
            break
        active_start = (
            _base_lr(r.at_step, schedule) if active is None else _segment(active, active_start, final, r.at_step)
        )
        active = r
    if active is None:
        return _base_lr(step, schedule)
    return _segment(active, active_start, final, step)


@dataclasses.dataclass(frozen=True)
class SeqLenPhase:
    """From ``start_fraction`` of the run's steps on, train at ``seq_len``."""

    start_fraction: float
    seq_len: int


@dataclasses.dataclass(frozen=True)
class SeqLenSchedule:
    """Sequence length by phase at a constant number of tokens per step.

    The hero starts at 4K, moves to 8K at ~50% and 65K at ~95% (as published); the batch in sequences shrinks
    so that ``batch * seq_len == tokens_per_step`` throughout. Phases are keyed by fractions of the
    horizon so that a re-planned horizon moves them with it.
    """

    tokens_per_step: int
    phases: tuple[SeqLenPhase, ...]

    def __post_init__(self) -> None:
        if not self.phases:
            raise ValueError("a schedule needs at least one phase, the first starting at 0")
        fractions = [p.start_fraction for p in self.phases]
        if fractions != sorted(fractions) or len(set(fractions)) != len(fractions):
            raise ValueError(f"phase start fractions must be strictly increasing, got {fractions}")
        if self.phases[0].start_fraction != 0.0:
            raise ValueError(f"the first phase must start at 0 (the run's first step), got {fractions[0]}")
        outside = [f for f in fractions if not 0.0 <= f < 1.0]  # NaN included: it compares false
        if outside:
            raise ValueError(f"a phase must start at a fraction of the run in [0, 1), got {outside[0]}")
        for p in self.phases:
            if p.seq_len <= 0 or self.tokens_per_step % p.seq_len:
                raise ValueError(
                    f"tokens_per_step {self.tokens_per_step} is not a multiple of seq_len {p.seq_len}"
                )

    @staticmethod
    def constant(tokens_per_step: int, seq_len: int) -> SeqLenSchedule:
        return SeqLenSchedule(tokens_per_step, (SeqLenPhase(0.0, seq_len),))


def phase_index_at(step: int, total_steps: int, schedule: SeqLenSchedule) -> int:
    """Index of the phase in force at ``step``; a phase starts at ``ceil(fraction * total_steps)``."""
    index = 0
    for i, p in enumerate(schedule.phases):
        if step >= phase_start_step(p.start_fraction, total_steps):
            index = i
    return index


def seq_len_at(step: int, total_steps: int, schedule: SeqLenSchedule) -> tuple[int, int]:
    """``(seq_len, batch_size)`` for ``step``; their product is always ``tokens_per_step``."""
    seq_len = schedule.phases[phase_index_at(step, total_steps, schedule)].seq_len
    return seq_len, schedule.tokens_per_step // seq_len


@dataclasses.dataclass(frozen=True)
class TransportSchedule:
    """EP transport by step: ``((0, "fixed"), (81716, "ragged_capacity"))`` reproduces the hero's hot switch.

    Switching transport changes only how tokens travel to experts, never the parameters, so the
    trainer recompiles the step and carries on with the same state.
    """

    switches: tuple[tuple[int, str], ...]

    def __post_init__(self) -> None:
        if not self.switches or self.switches[0][0] != 0:
            raise ValueError("the transport schedule must name the transport at step 0")
        steps = [s for s, _ in self.switches]
        if steps != sorted(steps) or len(set(steps)) != len(steps):
            raise ValueError(f"switch steps must be strictly increasing, got {steps}")

    @staticmethod
    def constant(transport: str) -> TransportSchedule:
        return TransportSchedule(((0, transport),))


def transport_at(step: int, schedule: TransportSchedule) -> str:
    """The transport in force at ``step``."""
    current = schedule.switches[0][1]
    for start, transport in schedule.switches:
        if step >= start:
            current = transport
    return current

