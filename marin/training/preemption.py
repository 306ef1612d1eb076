"""A final checkpoint on preemption: SIGTERM during training stops at the next step boundary, saved.

Schedulers (Kubernetes, Slurm, cloud spot reclaim) send SIGTERM and kill the process a grace period
later (Kubernetes' ``terminationGracePeriodSeconds``, 30 s by default). A training host that knows
the grace period can use it: the signal only sets a flag; the loop checks the flag between steps
(all hosts agree on process 0's view, since a save is collective), writes a checkpoint if the last
save took less than what is left of the grace period, and stops with :class:`Preempted`, an
infrastructure failure the executor retries from that checkpoint. ``preemption_grace_s = 0`` (the
default, right for tiny runs whose checkpoints are seconds apart) leaves SIGTERM alone.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

from marin.execution.failures import Preempted

__all__ = ["Preempted", "PreemptionWatch"]


class PreemptionWatch:
    """While active (:meth:`start` to :meth:`stop`, or as a context manager), SIGTERM sets
    :attr:`signalled_at` instead of ending the process."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = float(grace_s)
        self.signalled_at: float | None = None
        self._previous: Any = None
        self.active = self.grace_s > 0 and threading.current_thread() is threading.main_thread()

    def _handler(self, signum: int, frame: Any) -> None:
        if self.signalled_at is None:
            self.signalled_at = time.monotonic()

    def start(self) -> "PreemptionWatch":
        if self.active:
            self._previous = signal.signal(signal.SIGTERM, self._handler)
        return self

    def stop(self) -> None:
        """Give SIGTERM back to whoever handled it before (Ray's worker, the default)."""
        if self.active:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
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
