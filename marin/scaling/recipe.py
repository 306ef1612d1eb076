"""Rungs of a scaling ladder: smaller models trained with the target's (the hero's) recipe.

A rung keeps everything about the target except its width and depth: the same head size and GQA
ratio, the latent projection, expert and shared-expert widths as the same fractions of ``d_model``
(d/2 for the hero), the same number of routed experts, top-k and shared experts, the same attention
pattern (sliding window, one global layer in every ``global_every``), the same losses and router.
Its run keeps the target's *schedule shape*: the sequence-length phases and the warmup at the same
fractions of the run, the linear LR decay to the same final fraction of peak. Mixture stages are
fractions of the run too (:class:`marin.data.mixture.MixtureStage`), so every rung sees the target's
stage-2 data for the same share of its steps.

What a rung spends is its compute budget C (training FLOPs, forward + backward): the sum over the
sequence-length phases of tokens in the phase x :func:`marin.models.config.flops_per_token` at the
phase's length. Given a budget and a batch, the rung trains ``round(C / FLOPs per step)`` steps.

Pure functions, no JAX: experiment files call them at declaration time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from marin.models.config import MoEConfig, count_params, mean_flops_per_token
from marin.runsteps import phase_steps  # noqa: F401  (re-exported: the recipe's phase placement)
from marin.textfmt import format_table


class RecipeError(ValueError):
    """A rung that the recipe cannot build while keeping the target's ratios."""


@dataclasses.dataclass(frozen=True)
class RunShape:
    """The schedule shape of a run, everything as a fraction of its steps except the batch.

    ``seq_len_phases`` are ``(start fraction, seq_len)`` pairs at constant tokens per step (the hero:
    4K, 8K from 50%, 65K from 95%); the first one's length defines the batch in sequences.
    """

    seq_len_phases: tuple[tuple[float, int], ...]
    warmup_fraction: float
    final_lr_fraction: float = 0.05

    def __post_init__(self) -> None:
        if not self.seq_len_phases or self.seq_len_phases[0][0] != 0.0:
            raise RecipeError(f"seq_len_phases must start at fraction 0.0, got {self.seq_len_phases}")
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise RecipeError(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction}")

    @property
    def base_seq_len(self) -> int:
        return int(self.seq_len_phases[0][1])

    @staticmethod
    def of_run(seq_len_phases: Sequence[tuple[float, int]], warmup_steps: int, train_steps: int,
               final_lr_fraction: float = 0.05) -> RunShape:
        """The shape of a concrete run (e.g. the hero's 2,000 warmup steps of 390,139)."""
        return RunShape(tuple((float(f), int(n)) for f, n in seq_len_phases), warmup_steps / train_steps,
                        final_lr_fraction)


@dataclasses.dataclass(frozen=True)
class Rung:
    """One planned rung: its model, batch, steps and the compute they spend."""

    name: str
    model: MoEConfig
    batch_sequences: int
    train_steps: int
    warmup_steps: int
    shape: RunShape
    flops_budget: float
    budget_published: bool = False

    @property
    def tokens_per_step(self) -> int:
        return self.batch_sequences * self.shape.base_seq_len

    @property
    def tokens(self) -> int:
        return self.train_steps * self.tokens_per_step

    @property
    def flops(self) -> float:
        """Compute this rung actually spends (its budget, up to rounding the step count)."""
        return run_flops(self.model, self.train_steps, self.tokens_per_step, self.shape.seq_len_phases)

    @property
    def active_params(self) -> int:
        return count_params(self.model)["active_params"]

    @property
    def total_params(self) -> int:
        return count_params(self.model)["total_params"]


def rung_model(target: MoEConfig, d_model: int, n_layers: int) -> MoEConfig:
    """``target`` at width ``d_model`` and depth ``n_layers``, every ratio kept (see module docstring).

    KV heads follow the GQA ratio (at least one, and a divisor of the query heads: 6 heads at a 4:1
    ratio get one KV head), the local and the global layers' each by its own ratio.

    Raises :class:`RecipeError` when a ratio cannot be kept exactly (e.g. ``d_model`` not a multiple
    of the head size, or a latent width that would not be an integer)."""
    if d_model <= 0 or n_layers <= 0:
        raise RecipeError(f"need positive width and depth, got d_model={d_model}, n_layers={n_layers}")

    def scaled(field: str) -> int:
        num = getattr(target, field) * d_model
        if num % target.d_model:
            raise RecipeError(f"d_model {d_model}: {field} = {getattr(target, field)} x {d_model}/{target.d_model} "
                              f"is not an integer; choose a width that keeps the ratio")
        return num // target.d_model

    if d_model % target.head_dim:
        raise RecipeError(f"d_model {d_model} is not a multiple of the head size {target.head_dim}")
    n_heads = d_model // target.head_dim

    def kv_heads(target_kv: int, multiple_of: int = 1) -> int:
        # as many KV heads as the target's GQA ratio allows, at least one, dividing the query heads
        # (and dividing, or divided by, the other kind's count: one stored projection serves both)
        n_kv = max(1, n_heads // (target.n_heads // target_kv))
        while n_heads % n_kv or (multiple_of % n_kv and n_kv % multiple_of):
            n_kv -= 1
        return n_kv

    n_kv = kv_heads(target.n_kv_heads)
    n_kv_global = kv_heads(target.kv_heads_global, n_kv)
    return dataclasses.replace(
        target, d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
        n_kv_heads_global=None if n_kv_global == n_kv else n_kv_global,
        latent_dim=scaled("latent_dim"), expert_width=scaled("expert_width"), shared_width=scaled("shared_width"),
    )


def run_flops(model: MoEConfig, train_steps: int, tokens_per_step: int,
              seq_len_phases: Sequence[tuple[float, int]]) -> float:
    """Training FLOPs of a run: its tokens x FLOPs per token over its phases, as the trainer places them."""
    if train_steps <= 0:
        return 0.0
    return train_steps * tokens_per_step * mean_flops_per_token(model, seq_len_phases, train_steps)


def flops_per_step(model: MoEConfig, tokens_per_step: int, seq_len_phases: Sequence[tuple[float, int]]) -> float:
    """Mean FLOPs per step over the run's phases, before the step count is known (phases weighted by
    their fraction of the run; :func:`run_flops` is the same rule once the steps are known)."""
    return tokens_per_step * mean_flops_per_token(model, seq_len_phases)


def ladder_rungs(
    target: MoEConfig,
    widths: Sequence[int],
    *,
    shape: RunShape,
    depths: Mapping[int, int],
    batch_sequences: int | Mapping[int, int],
    budgets: Mapping[int, float] | None = None,
    tokens_per_active_param: float | None = None,
    published: Sequence[int] = (),
    name: str = "d{d}",
) -> list[Rung]:
    """Rungs at ``widths`` that keep ``target``'s ratios and run ``shape``.

    ``depths`` maps width -> layers (depth is the one architectural choice the ratios leave open).
    A rung's compute budget is ``budgets[width]`` when given, else ``tokens_per_active_param`` x its
    active parameters tokens (at its FLOPs per token); one of the two must cover every width.
    ``published`` marks the widths whose budgets are published facts rather than assumptions.
    """
    if not widths:
        raise RecipeError("a ladder needs at least one width")
    if len(set(widths)) != len(widths):
        raise RecipeError(f"widths repeat: {list(widths)}")
    rungs = []
    for d in widths:
        if d not in depths:
            raise RecipeError(f"width {d}: no depth given; depths cover {sorted(depths)}")
        model = rung_model(target, d, int(depths[d]))
        batch = int(batch_sequences[d] if isinstance(batch_sequences, Mapping) else batch_sequences)
        if batch <= 0:
            raise RecipeError(f"width {d}: batch must be positive, got {batch}")
        tokens_per_step = batch * shape.base_seq_len
        per_step = flops_per_step(model, tokens_per_step, shape.seq_len_phases)
        if budgets is not None and d in budgets:
            budget = float(budgets[d])
        elif tokens_per_active_param is not None:
            budget = tokens_per_active_param * count_params(model)["active_params"] * per_step / tokens_per_step
        else:
            raise RecipeError(f"width {d}: no compute budget; give budgets[{d}] or tokens_per_active_param")
        steps = max(1, round(budget / per_step))
        warmup = min(steps - 1, max(1, round(shape.warmup_fraction * steps))) if steps > 1 else 0
        rungs.append(Rung(name.format(d=d), model, batch, steps, warmup, shape, budget, d in set(published)))
    return rungs


def format_ladder(rungs: Sequence[Rung], target_flops: float, target_name: str = "hero") -> str:
    """A table of the rungs and their share of the target's compute (and the ladder's total share)."""
    any_published = any(r.budget_published for r in rungs)
    rows = [(r.name, r.model.n_layers, f"{r.active_params / 1e9:.3g}B", f"{r.total_params / 1e9:.3g}B",
             f"{r.batch_sequences:,}", f"{r.train_steps:,}", f"{r.tokens:.3g}", f"{r.tokens / r.active_params:.0f}",
             f"{r.flops:.3g}", f"{100 * r.flops / target_flops:.3f}%",
             "" if r.budget_published or not any_published else "(budget assumed)")
            for r in rungs]
    header = ("rung", "layers", "active", "total", "batch", "steps", "tokens", "tok/param", "FLOPs",
              f"% {target_name}", "")
    total = sum(r.flops for r in rungs)
    return (format_table(header, rows, right=range(1, 10), rule=False) +
            f"\nladder total {total:.3g} FLOPs = {100 * total / target_flops:.2f}% of the {target_name}'s "
            f"{target_flops:.3g}")
