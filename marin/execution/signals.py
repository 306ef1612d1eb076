"""The driver's stop signals: SIGINT (Ctrl-C), SIGTERM (what schedulers send on preemption) and SIGHUP
(the terminal went away) all stop a run the same way (see :meth:`executor._Runner.interrupt`)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


class RunStopped(KeyboardInterrupt):
    """A stop signal reached the driver: SIGINT (Ctrl-C), SIGTERM (what schedulers send on preemption)
    or SIGHUP (the terminal went away). A KeyboardInterrupt, so every cleanup path of Ctrl-C serves all
    three."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def stop_reason(signum: int) -> str:
    """How a person reads the signal that stopped a run: ``Ctrl-C`` or ``SIGTERM``/``SIGHUP``."""
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


class StopSignals:
    """The driver's handlers for :data:`STOP_SIGNALS`: each raises :class:`RunStopped` in the main thread.

    :meth:`install` again after ``ray.init``, which replaces the SIGTERM handler with its own (it
    would stop the cluster and exit with status 1, leaving RUNNING steps behind). :meth:`deferred`
    holds signals off while a section must not be cut short (stopping the cluster, recording an
    interruption); the first one that arrived meanwhile is kept in :attr:`received`."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self._defer = 0
        self.active = threading.current_thread() is threading.main_thread()

    def _handler(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum
        if not self._defer:
            raise RunStopped(signum)

    def install(self) -> None:
        if not self.active:
            return
        for sig in STOP_SIGNALS:
            previous = signal.signal(sig, self._handler)
            self._previous.setdefault(sig, previous)

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self._defer += 1
        try:
            yield
        finally:
            self._defer -= 1

    def __enter__(self) -> "StopSignals":
        self.install()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()


def signal_of(exc: BaseException, signals: StopSignals | None) -> int:
    """The signal behind a KeyboardInterrupt: Ray's waits re-raise a plain KeyboardInterrupt in place of
    :class:`RunStopped`, so the handlers' record is the authority."""
    if signals is not None and signals.received is not None:
        return signals.received
    return getattr(exc, "signum", signal.SIGINT)
