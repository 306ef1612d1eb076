"""A run stopped by a signal: stopping the steps the driver holds, recording them INTERRUPTED, and
the message that says what was kept and how to resume.

The driver's handlers turn SIGINT, SIGTERM and SIGHUP into one stop (:mod:`marin.execution.signals`);
this is what the stop does. A running step with a grace period (``ExecutorStep.stop_grace_s``, a
training step's ``preemption_grace_s``) is first asked to save and stop by itself (a stop request in
its directory); the others are cancelled at once. Then every step the driver holds is recorded
INTERRUPTED and its lease released. The stop runs once, however many signals follow (a second
signal meanwhile is ignored, so a scheduler's repeated SIGTERM cannot leave a step RUNNING with a
dead holder); only a second Ctrl-C cuts a grace period short.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from marin.execution import retry
from marin.execution import status as st
from marin.execution.errors import ExecutorInterrupted
from marin.execution.experiment_record import write_experiment_record
from marin.execution.failures import StopRequested
from marin.execution.jsonable import mask_argv
from marin.execution.lease_keeper import LeaseKeeper
from marin.execution.options import RunOptions
from marin.execution.outcome import Outcome, RunResult
from marin.execution.plan import Plan, PlannedStep
from marin.execution.signals import STOP_RESERVE_S, STOP_SIGNALS, clear_stop_request, request_stop, stop_reason
from marin.execution.status import StepStatus
from marin.execution.tasks import describe_failure

logger = logging.getLogger("marin.execution")

INTERRUPT_RETRY_S = 10.0
"""How long recording an interruption rides out a store outage: a person waits for the prompt, and a
scheduler's grace period (30 s on Kubernetes by default) is short."""


class Stopper:
    """Stops the steps of one driver: ``running`` (Ray object ref -> step, the driver's live map),
    the leases in ``keeper``; ``on_done(ref)`` commits a step that finished during its grace
    period as any other; ``say`` prints a line for the person watching."""

    def __init__(self, running: dict[Any, PlannedStep], keeper: LeaseKeeper, on_done: Callable[[Any], None],
                 say: Callable[[str], None]) -> None:
        self.running, self.keeper, self.on_done, self.say = running, keeper, on_done, say

    def stop(self, signum: int = signal.SIGINT) -> dict[PlannedStep, str | None]:
        """Stop every step this driver holds, record it INTERRUPTED, release its lease; returns the
        steps recorded so, each with what it did in its grace period (None without one)."""
        in_main = threading.current_thread() is threading.main_thread()
        insist = threading.Event()

        def again(sig: int, frame: Any) -> None:
            if sig == signal.SIGINT:
                insist.set()

        previous = {sig: signal.signal(sig, again) for sig in STOP_SIGNALS} if in_main else {}
        try:
            notes = self.let_steps_stop(signum, insist)
            return self.record_interrupted(f"the run was stopped ({stop_reason(signum)})", notes)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    @staticmethod
    def cancel(ref: Any) -> None:
        import ray  # Ray only once steps run: planning and review import the executor

        try:
            ray.cancel(ref, force=True)
        except Exception:  # already finished or the cluster is going away: nothing to stop
            pass

    def let_steps_stop(self, signum: int, insist: threading.Event) -> dict[PlannedStep, str]:
        """Ask each running step with a grace period to save and stop (a stop request in its
        directory), and wait for it until that grace period is up, less :data:`STOP_RESERVE_S` the
        step leaves the driver; a step that finished meanwhile is committed as usual. Returns what
        each of them did, for its INTERRUPTED record."""
        import ray  # Ray only once steps run: planning and review import the executor

        graceful = {ref: s for ref, s in self.running.items() if s.step.stop_grace_s > 0}
        if not graceful:
            return {}
        began = time.monotonic()
        for ref in self.running:
            if ref not in graceful:  # nothing to save: stopped at once, as without a grace period
                self.cancel(ref)
        with retry.capped(INTERRUPT_RETRY_S):
            for s in graceful.values():
                try:
                    request_stop(s.output_path, signum, s.step.stop_grace_s - STOP_RESERVE_S)
                except Exception as e:  # noqa: BLE001 - the store is down: the step is cancelled at its deadline
                    logger.error("step %s: could not ask it to stop: %s", s.name, e)
        deadline = {ref: began + s.step.stop_grace_s for ref, s in graceful.items()}
        longest = max(s.step.stop_grace_s for s in graceful.values())
        self.say(f"stopping ({stop_reason(signum)}): {len(graceful)} step(s) may take up to {longest:.0f}s to "
                 "save their work and stop" + ("; Ctrl-C again stops them at once" if signum == signal.SIGINT
                                               else ""))
        notes: dict[PlannedStep, str] = {}
        pending = list(graceful)
        while pending and not insist.is_set():
            now = time.monotonic()
            for ref in [r for r in pending if deadline[r] <= now]:
                pending.remove(ref)
                s = graceful[ref]
                notes[s] = f"it did not stop within its {s.step.stop_grace_s:.0f}s grace period and was cancelled"
            if not pending:
                break
            timeout = min(0.5, min(deadline[r] for r in pending) - now)  # short: a second Ctrl-C is seen
            done, _ = ray.wait(pending, num_returns=len(pending), timeout=max(0.0, timeout))
            for ref in done:
                pending.remove(ref)
                s = graceful[ref]
                try:
                    ray.get(ref)
                except Exception as e:  # noqa: BLE001 - the step stopped (or failed) in its grace period
                    # ended: never cancelled (Ray aborts when a force-cancel races the task's reply)
                    self.running.pop(ref, None)
                    cause = getattr(e, "cause", None)
                    notes[s] = (str(cause).splitlines()[0] if isinstance(cause, StopRequested)
                                else f"it ended with {describe_failure(e)[0]}")
                else:
                    self.on_done(ref)  # it finished in its grace period: SUCCESS, as any other
        for ref in pending:
            notes[graceful[ref]] = "it was cancelled by a second Ctrl-C"
        return notes

    def record_interrupted(self, message: str, notes: dict[PlannedStep, str]) -> dict[PlannedStep, str | None]:
        """Cancel what still runs; record every held step INTERRUPTED (with its note) and release it."""
        stopped: dict[PlannedStep, str | None] = {}
        with retry.capped(INTERRUPT_RETRY_S):  # the person (or the scheduler's grace period) is waiting
            for ref in list(self.running):
                self.cancel(ref)
            for s, lease in self.keeper.items():
                note = notes.get(s)
                try:
                    record = st.read_status(s.output_path)
                    if st.current_status(record) == StepStatus.RUNNING:
                        st.write_status(s.output_path, StepStatus.INTERRUPTED, lease=lease,
                                        message=f"{message}; {note}" if note else message, previous=record)
                    if s.step.stop_grace_s > 0:
                        clear_stop_request(s.output_path)
                except Exception as e:  # pragma: no cover - store unreachable
                    logger.error("step %s: could not record the interruption: %s", s.name, e)
                self.keeper.release(s)
                stopped[s] = note
        return stopped


def interrupted_error(plan: Plan, opts: RunOptions, outcome: dict[str, Outcome], errors: dict[str, str],
                      stop_notes: dict[str, str], signum: int = signal.SIGINT, *, during: str | None = None,
                      record: str | None = None) -> ExecutorInterrupted:
    """The message (and record) for a run stopped by a signal: what stopped, what is kept, how to resume.

    ``during``: the signal came after every step had ended, while the driver was ``during`` (stopping
    the Ray cluster, writing the record), whose ``record`` is then written already."""
    if record is None:
        try:
            record = write_experiment_record(plan, opts, outcome)
        except Exception:  # the record is a convenience; the statuses are what the next run reads
            record = None
    stopped = [s for s in plan.steps if outcome.get(s.output_path) == Outcome.INTERRUPTED]
    failed = [s for s in plan.steps if outcome.get(s.output_path) in (Outcome.FAILED, Outcome.LOST)]
    done = sum(1 for v in outcome.values() if v in (Outcome.SUCCEEDED, Outcome.REUSED))
    head = "interrupted (Ctrl-C)" if signum == signal.SIGINT else f"stopped by {stop_reason(signum)}"
    lines = [f"{head} while {during}, after every step had ended." if during else f"{head}."]
    if stopped:
        lines.append(f"{len(stopped)} running step(s) stopped and marked INTERRUPTED, their leases released:")
        for s in stopped:
            note = stop_notes.get(s.output_path)
            lines.append(f"  {s.name} ({s.output_path})" + (f"\n      {note}" if note else ""))
    elif not during:
        lines.append("No step was running.")
    lines.append(f"{done} step(s) finished in this run and are kept" + (f" (record: {record})." if record else "."))
    if failed:
        lines.append(f"{len(failed)} step(s) failed (see why with `marin show PATH`; rerun one with "
                     "--retry_failed STEP):")
        for s in failed:
            error = (errors.get(s.output_path) or "").split("\n", 1)[0]
            lines.append(f"  {s.name} ({s.output_path}): {error}")
    command = shlex.join(mask_argv([os.path.basename(sys.executable), *sys.argv]))
    if stopped or not during:
        lines.append(f"To resume, run the same command again: {command}")
    err = ExecutorInterrupted("\n".join(lines))
    err.signum = signum
    err.result = RunResult(plan, outcome, record, errors)  # type: ignore[attr-defined]
    return err
