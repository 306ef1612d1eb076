"""A run's resubmissions of steps that failed for the infrastructure's reasons.

A lost host or a preempted node says nothing about the step (see :mod:`marin.execution.failures`),
and the step resumes from what it committed, so the driver resubmits it by itself: at most the
step's own number of times (a device pool's steps retry, the rest do not) or ``--infra_retries``
for every step, each after a backoff (:data:`INFRA_BACKOFF`, the one exponential backoff of
:class:`~marin.execution.retry.RetryPolicy`). This module keeps that bookkeeping: how many
infrastructure failures each step had, which failures are resubmitted, and when each waiting step
is due; the scheduler only records the attempt and submits what is due.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

from marin.execution.failures import is_infrastructure_failure
from marin.execution.plan import PlannedStep
from marin.execution.retry import RetryPolicy

INFRA_BACKOFF = RetryPolicy(first_delay_s=2.0, max_delay_s=60.0)
"""The wait before a step's next attempt after an infrastructure failure: 2 s, doubling, at most a minute."""


class InfraRetries:
    """One run's infrastructure retries: the failures counted per step and the resubmissions due.

    ``run_wide_limit`` is ``--infra_retries`` (None: each step's own ``infra_retries``)."""

    def __init__(self, run_wide_limit: int | None, backoff: RetryPolicy = INFRA_BACKOFF,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.run_wide_limit = run_wide_limit
        self.backoff = backoff
        self.clock = clock
        self.failures: collections.Counter[PlannedStep] = collections.Counter()
        """Infrastructure failures retried so far, per step."""
        self.due_at: dict[PlannedStep, float] = {}
        """Steps waiting out their backoff, with when (``clock``) their next attempt is due."""

    def limit(self, s: PlannedStep) -> int:
        """How often ``s`` is resubmitted after infrastructure failures: ``--infra_retries`` for every
        step when given, else the step's own."""
        if self.run_wide_limit is not None:
            return self.run_wide_limit
        return s.step.infra_retries or 0

    def retries(self, s: PlannedStep, exc: BaseException) -> bool:
        """Whether ``s``, failed with ``exc``, is resubmitted: an infrastructure failure with retries left."""
        return is_infrastructure_failure(exc) and self.failures[s] < self.limit(s)

    def schedule(self, s: PlannedStep) -> tuple[int, float]:
        """Count ``s``'s infrastructure failure and make its next attempt due after the backoff;
        returns (failures so far, seconds until the next attempt)."""
        self.failures[s] += 1
        n = self.failures[s]
        delay = self.backoff.delay(n)
        self.due_at[s] = self.clock() + delay
        return n, delay

    def describe(self, s: PlannedStep, error: str, n: int, delay: float) -> str:
        """The line recorded (and printed) for ``s``'s ``n``-th retried infrastructure failure."""
        return (f"infrastructure failure ({error}); attempt {n + 1} of {self.limit(s) + 1} "
                f"starts in {delay:.0f}s from what the step committed")

    def after(self, s: PlannedStep, error: str) -> str:
        """``error``, the failure that ends ``s``, saying how many infrastructure failures were retried before it."""
        if self.failures[s]:
            return f"{error} (after {self.failures[s]} retried infrastructure failure(s))"
        return error

    def pop_due(self) -> list[PlannedStep]:
        """The steps whose backoff is over, no longer waiting."""
        now = self.clock()
        due = [s for s, at in self.due_at.items() if at <= now]
        for s in due:
            del self.due_at[s]
        return due

    @property
    def waiting(self) -> bool:
        """Whether a step waits out its backoff."""
        return bool(self.due_at)
