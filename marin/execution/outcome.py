"""What a run did with each step (:class:`Outcome`) and what :func:`executor_main` returns (:class:`RunResult`).

A step's *status* (:class:`marin.execution.status.StepStatus`) is what its directory records and
every later run reads; its *outcome* is what this one run did with it, which the experiment record
keeps per run (a step found finished is ``cached`` here and SUCCESS there).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from marin.execution.plan import Plan


class Outcome(enum.StrEnum):
    """What one run did with one step. A ``str``: records, tests and callers compare it with its text."""

    CACHED = "cached"
    """It had succeeded before this run started."""
    SUCCEEDED = "succeeded"
    """This run ran it and committed its SUCCESS."""
    REUSED = "reused"
    """Another driver finished it while this run waited for its lease."""
    FAILED = "failed"
    """It failed in this run (or in a concurrent driver's, which this run found)."""
    DEP_FAILED = "dep_failed"
    """Not run: a blocking dependency did not succeed (or was not SUCCESS when the step's task started)."""
    LOST = "lost"
    """Its lease was taken over by another driver while this run held it; this run wrote nothing more."""
    INTERRUPTED = "interrupted"
    """A stop signal reached the driver while it ran; recorded INTERRUPTED, the next run resumes it."""
    NOT_SELECTED = "not_selected"
    """Left alone: unfinished, but not asked for by ``--run_only``."""
    DRY_RUN = "dry_run"
    """Would run; a dry run runs nothing."""

    @property
    def finished(self) -> bool:
        """The step has its outputs after this run (it ran and succeeded, or had succeeded before)."""
        return self in FINISHED

    @property
    def failed(self) -> bool:
        """The step itself failed or lost its lease in this run (a dependency's failure is not its own)."""
        return self in (Outcome.FAILED, Outcome.LOST)


FINISHED = frozenset({Outcome.CACHED, Outcome.SUCCEEDED, Outcome.REUSED})
"""Outcomes after which a step's outputs may be read."""


@dataclasses.dataclass
class RunResult:
    plan: Plan
    outcome: dict[str, Outcome]
    """Output path -> what this run did with the step (an :class:`Outcome`, which compares equal to its text)."""
    record_path: str | None
    errors: dict[str, str] = dataclasses.field(default_factory=dict)

    def finished(self, step: Any) -> bool:
        """Whether ``step`` (an ExecutorStep of the plan) has its outputs after this run: it ran and
        succeeded, or had succeeded before. A closing summary reads only such steps' outputs (with
        ``--run_only`` the others may never have run)."""
        return self.outcome.get(self.plan.planned(step).output_path) in FINISHED
