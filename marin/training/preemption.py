"""A final checkpoint on preemption: SIGTERM during training stops at the next step boundary, saved.

Schedulers (Kubernetes, Slurm, cloud spot reclaim) send SIGTERM and kill the process a grace period
later (Kubernetes' ``terminationGracePeriodSeconds``, 30 s by default). A training host that knows
the grace period can use it: the signal only sets a flag; the loop checks the flag between steps
(all hosts agree on process 0's view, since a save is collective), writes a checkpoint if the last
save took less than what is left of the grace period, and stops with :class:`Preempted`, an
infrastructure failure the executor retries from that checkpoint. ``preemption_grace_s = 0`` (the
default, right for tiny runs whose checkpoints are seconds apart) leaves SIGTERM alone.

The signal may reach the driver (``marin run``) instead of the hosts: the driver then writes a stop
request into the step directory (:mod:`marin.execution.signals`), which process 0 polls; training
stops the same way, within what the request leaves of the grace period, with :class:`StopRequested`
(not retried: the run is ending; the next run resumes from that checkpoint).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

from marin.execution.failures import Preempted, StopRequested
from marin.execution.signals import read_stop_request

__all__ = ["Preempted", "PreemptionWatch", "StopRequested"]

logger = logging.getLogger(__name__)

POLL_S = 1.0
"""How often process 0 looks for the driver's stop request (one small read of the step directory)."""


class PreemptionWatch:
    """While active (:meth:`start` to :meth:`stop`, or as a context manager), SIGTERM sets
    :attr:`signalled_at` instead of ending the process, and so does the driver's stop request in
    ``step_dir`` (when given: process 0 of the pool watches for all of them).

    Active whenever ``grace_s > 0``, on every process of the pool (the loop's check is collective);
    the SIGTERM handler is installed only from the main thread (where Python delivers signals: a
    Ray actor's methods run there)."""

    def __init__(self, grace_s: float, step_dir: str | None = None, poll_s: float = POLL_S) -> None:
        self.grace_s = float(grace_s)
        self.signalled_at: float | None = None
        self.by_driver = False
        """Whether the stop came from the driver's request (else a SIGTERM to this process)."""
        self.reason = "SIGTERM"
        self.step_dir, self.poll_s = step_dir, poll_s
        self._previous: Any = None
        self.active = self.grace_s > 0
        self._handles_signal = self.active and threading.current_thread() is threading.main_thread()
        self._done = threading.Event()
        self._poller: threading.Thread | None = None

    def _handler(self, signum: int, frame: Any) -> None:
        if self.signalled_at is None:
            self.signalled_at = time.monotonic()

    def _poll(self) -> None:
        while not self._done.wait(self.poll_s):
            try:
                request = read_stop_request(self.step_dir)
            except Exception as e:  # noqa: BLE001 - an unreachable store: look again next time
                logger.debug("could not look for a stop request in %s: %s", self.step_dir, e)
                continue
            if request is not None and self.signalled_at is None:
                self.grace_s = min(self.grace_s, request.budget_s)
                self.reason, self.by_driver = f"{request.signal} to the driver", True
                # it may have waited up to one poll interval: count that against the budget
                self.signalled_at = time.monotonic() - self.poll_s
            if request is not None or self.signalled_at is not None:
                return

    def start(self) -> "PreemptionWatch":
        if self._handles_signal:
            self._previous = signal.signal(signal.SIGTERM, self._handler)
        if self.active and self.step_dir:
            self._poller = threading.Thread(target=self._poll, name="marin-stop-request", daemon=True)
            self._poller.start()
        return self

    def stop(self) -> None:
        """Give SIGTERM back to whoever handled it before (Ray's worker, the default)."""
        self._done.set()
        if self._handles_signal:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._handles_signal = False
        self.active = False

    def __enter__(self) -> "PreemptionWatch":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def requested(self) -> bool:
        return self.signalled_at is not None

    def time_left(self) -> float:
        """Seconds of the grace period left (0 before a signal arrived: nothing to spend)."""
        if self.signalled_at is None:
            return 0.0
        return max(0.0, self.grace_s - (time.monotonic() - self.signalled_at))

    def worth_saving(self, save_s: float | None) -> bool:
        """Whether a save taking about ``save_s`` seconds (the last one's; None: never saved in this
        process) fits what is left of the grace period, with a margin for exiting."""
        estimate = save_s if save_s is not None else 0.0
        return self.time_left() > 1.5 * estimate + 1.0
