"""The hero's sampling recipe over Harrier K40: what is published, and what is assumed where it is not.

Published (the Marin 535B-A23B run): the candidate pool's 40 domains at their shares
(:func:`marin.data.k40.published_shares`); a two-stage sampling design, uniform within each domain
first and quality-weighted later, so the mixture changes without re-tokenizing; and a pretraining /
mid-training split of 15T + 3.75T tokens, i.e. mid-training is the last 20% of the run's tokens.

Not published, so assumed here (and said wherever it is used): where the quality-weighted stage
starts (30% of the run), its bucket weights, and what mid-training favours. We assume mid-training
keeps the domain shares and weights the top two quality buckets (q4, q5) up twice as much again as
the quality-weighted stage does; the lower buckets keep their stage-2 weights, so no domain runs
out of text. Everything here is a fraction of the run, so a ladder rung or a shortened run gets the
same recipe at its own length; the hero's schedule (steps x batch) reads 18.0T tokens rather than
the published 18.75T, so its mid-training stage reads 20% of 18.0T.

The mixture is data; these are plain values and :class:`~marin.data.mixture.MixtureStage` objects,
read by the experiment that builds the hero's mixture and by ``marin plan`` to show the recipe.
"""

from __future__ import annotations

from marin.data.mixture import MixtureStage
from marin.runsteps import phase_start_step

PRETRAINING_TOKENS = 15.0e12
"""Published: tokens of the pretraining stage."""
MIDTRAINING_TOKENS = 3.75e12
"""Published: tokens of the mid-training stage, after pretraining."""
MIDTRAINING_FRACTION = MIDTRAINING_TOKENS / (PRETRAINING_TOKENS + MIDTRAINING_TOKENS)
"""The share of the run's tokens in mid-training (0.2); it starts at 1 - this of the run."""

QUALITY_STAGE_FRACTION = 0.3
"""Assumed: where the quality-weighted stage starts (the published design says only "later")."""
QUALITY_WEIGHTS: dict[str, float] = {"q1": 0.25, "q2": 0.5, "q3": 1.0, "q4": 2.0, "q5": 4.0}
"""Assumed: the quality-weighted stage's bucket weights (a starting point to tune on the ladder)."""
MIDTRAINING_QUALITY_WEIGHTS: dict[str, float] = {**QUALITY_WEIGHTS, "q4": 4.0, "q5": 8.0}
"""Assumed: mid-training weights the top two buckets up twice as much again (what it favours is not
published)."""


def hero_stages(midtraining: bool = True) -> tuple[MixtureStage, ...]:
    """The stages after the first (uniform within each domain, from step 0): quality-weighted from
    :data:`QUALITY_STAGE_FRACTION`, then, with ``midtraining``, the mid-training stage for the last
    :data:`MIDTRAINING_FRACTION` of the run."""
    stages = [MixtureStage(start_fraction=QUALITY_STAGE_FRACTION, quality_weights=QUALITY_WEIGHTS)]
    if midtraining:
        stages.append(MixtureStage(start_fraction=1.0 - MIDTRAINING_FRACTION,
                                   quality_weights=MIDTRAINING_QUALITY_WEIGHTS))
    return tuple(stages)


def _weights(w: dict[str, float]) -> str:
    return " ".join(f"{k} {v:g}" for k, v in w.items())


def stage_lines(total_steps: int, tokens_per_step: int) -> list[str]:
    """The hero's stages as ``marin plan`` prints them: each one's first step, share of the run and
    tokens at this schedule, and its weights (with which are assumed)."""
    starts = [0] + [phase_start_step(s.start_fraction, total_steps) for s in hero_stages()]
    ends = starts[1:] + [total_steps]
    what = ["pretraining: K40 domain shares, uniform within each domain (published)",
            f"pretraining, quality-weighted ({_weights(QUALITY_WEIGHTS)}; start and weights assumed)",
            f"mid-training (published: the last {MIDTRAINING_FRACTION:.0%}, {PRETRAINING_TOKENS / 1e12:g}T + "
            f"{MIDTRAINING_TOKENS / 1e12:g}T): {_weights(MIDTRAINING_QUALITY_WEIGHTS)} (assumed: the top two "
            "buckets weighted up)"]
    return [f"  from step {a:,} ({a / total_steps:.0%}, {(b - a) * tokens_per_step / 1e12:.2f}T tokens): {w}"
            for a, b, w in zip(starts, ends, what)]
