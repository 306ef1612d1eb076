"""Where a fraction of a run starts, in steps: the one rounding rule every schedule shares.

Sequence-length phases (``(0.5, 8192)``), mixture stages (``start_fraction=0.3``), the planner's and
the ladder's per-phase FLOPs all place "x% of the run" on a step with :func:`phase_start_step`, so
the trainer, the data loader and every prediction agree on the step where a phase begins. A
top-level helper (no marin imports): the data, training and scaling layers all call it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence


def phase_start_step(fraction: float, total_steps: int) -> int:
    """First step of a phase that starts at ``fraction`` of a ``total_steps`` run (ceil of the product).

    Integer arithmetic on the fraction rounded to 1e-9 avoids float drift at the edges: 0.95 x 20
    lands on 19, not on 19.000000000000004 -> 20."""
    numerator = round(fraction * 1_000_000_000)
    return -(-numerator * total_steps // 1_000_000_000)


def phase_steps(train_steps: int, seq_len_phases: Sequence[tuple[float, int]]) -> list[tuple[int, int]]:
    """``(steps, seq_len)`` per phase of a ``train_steps`` run (``((0.0, 4096), (0.5, 8192))``)."""
    starts = [phase_start_step(float(f), train_steps) for f, _ in seq_len_phases] + [train_steps]
    return [(max(0, min(b, train_steps) - min(a, train_steps)), int(n))
            for (a, b), (_, n) in zip(itertools.pairwise(starts), seq_len_phases)]


def phase_weights(seq_len_phases: Sequence[tuple[float, int]],
                  train_steps: int | None = None) -> list[tuple[float, int]]:
    """``(share of the run's steps, seq_len)`` per phase: the exact shares of :func:`phase_steps` when
    ``train_steps`` is known, else the fractions themselves (the limit of a long run; what a plan made
    before the step count exists uses)."""
    if train_steps is not None:
        return [(steps / train_steps, n) for steps, n in phase_steps(train_steps, seq_len_phases)]
    bounds = [float(f) for f, _ in seq_len_phases] + [1.0]
    return [(b - a, int(n)) for a, b, (_, n) in zip(bounds[:-1], bounds[1:], seq_len_phases)]
