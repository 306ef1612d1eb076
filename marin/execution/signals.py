"""The driver's stop signals: SIGINT (Ctrl-C), SIGTERM (what schedulers send on preemption) and SIGHUP
(the terminal went away) all stop a run the same way: running steps are stopped and recorded INTERRUPTED.

A step that can save its work (training, with a grace period: ``ExecutorStep.stop_grace_s``) is not
cancelled at once: the driver writes a stop request into its directory (``.executor_stop``), waits
up to the grace period for the step to save and stop by itself, then records it. A file in the step
directory, not a signal to the step's processes: the driver cannot signal processes on other nodes,
every host of a pool can read the step directory (it holds their checkpoints), and one reader
(process 0 of a pool, which decides for all of them) is enough. The driver keeps
:data:`STOP_RESERVE_S` of the grace period for itself (ending the pool, recording the stop), so the
stop is recorded before the scheduler's SIGKILL when the grace period is the scheduler's."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from marin.execution import storage


class RunStopped(KeyboardInterrupt):
    """A stop signal reached the driver: SIGINT (Ctrl-C), SIGTERM (what schedulers send on preemption)
    or SIGHUP (the terminal went away). A KeyboardInterrupt, so every cleanup path of Ctrl-C serves all
    three."""

    def __init__(self, signum: int, source: StopSignals | None = None) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.source = source
        """The handlers that raised it, if any (to raise it again if Python swallowed it)."""


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def stop_reason(signum: int) -> str:
    """How a person reads the signal that stopped a run: ``Ctrl-C`` or ``SIGTERM``/``SIGHUP``."""
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


class StopSignals:
    """The driver's handlers for :data:`STOP_SIGNALS`: each raises :class:`RunStopped` in the main thread.

    :meth:`install` again after ``ray.init``, in case it put its own SIGTERM handler in (the driver
    leaves Ray's out, where Ray's helper for it exists: it would exit the process at once, leaving
    RUNNING steps behind). :meth:`deferred`
    holds signals off while a section must not be cut short (stopping the cluster, recording an
    interruption); the first one that arrived meanwhile is kept in :attr:`received`, and what the
    driver was doing then in :attr:`received_during`."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.received_during: str | None = None
        self._previous: dict[int, Any] = {}
        self._deferring: list[str] = []
        self._unraisable_previous: Any = None
        self.active = threading.current_thread() is threading.main_thread()

    def _handler(self, signum: int, frame: Any) -> None:
        if self.received is not None:
            return  # a stop has begun: the stop path runs once, however many signals follow
        self.received = signum
        self.received_during = self._deferring[-1] if self._deferring else None
        if not self._deferring:
            raise RunStopped(signum, self)

    def note(self, signum: int) -> None:
        """Count a stop signal that reached the process past these handlers as received (``ray.init``'s
        own SIGTERM handler takes the signals while a local cluster starts): the stop path that follows
        runs once, and later signals are noted, not raised."""
        if self.received is None:
            self.received = signum

    def install(self) -> None:
        if not self.active or _exiting:
            return
        for sig in STOP_SIGNALS:
            previous = signal.signal(sig, self._handler)
            self._previous.setdefault(sig, previous)
        global _unraisablehook_before
        if sys.unraisablehook is not raise_swallowed_stop_again:
            self._unraisable_previous = _unraisablehook_before = sys.unraisablehook
            sys.unraisablehook = raise_swallowed_stop_again

    def restore(self) -> None:
        if _exiting:  # the process is on its way out because of a stop: signals stay ignored
            self._previous.clear()
            return
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        if self._unraisable_previous is not None:
            sys.unraisablehook, self._unraisable_previous = self._unraisable_previous, None

    @contextlib.contextmanager
    def deferred(self, doing: str = "recording the stop") -> Iterator[None]:
        """Hold stop signals off while ``doing`` (how a person reads it: "stopping the Ray cluster")."""
        self._deferring.append(doing)
        try:
            yield
        finally:
            self._deferring.pop()

    def __enter__(self) -> "StopSignals":
        self.install()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()


def raise_swallowed_stop_again(unraisable: Any) -> None:
    """``sys.unraisablehook`` while :class:`StopSignals` are installed.

    A signal handler runs wherever the main thread is, also where Python only reports an exception and
    goes on: ``logging``'s fork handlers, which run at every ``os.fork`` (a local cluster's start forks
    its processes). A :class:`RunStopped` raised there was lost (a traceback printed, and the run went
    on to its end with its stop noted as begun), so the same signal is sent again instead, shortly, from
    a thread: sent from here, its handler would run in this hook, where it is swallowed too; until then
    further signals are noted, as after any stop. Anything else is reported as before."""
    exc = unraisable.exc_value
    source = getattr(exc, "source", None)
    if isinstance(exc, RunStopped) and source is not None and source.received == exc.signum:
        def again() -> None:
            source.received = source.received_during = None  # not begun after all: this one raises
            os.kill(os.getpid(), exc.signum)

        timer = threading.Timer(STOP_AGAIN_AFTER_S, again)
        timer.daemon = True
        timer.start()
        return
    (_unraisablehook_before or sys.__unraisablehook__)(unraisable)


STOP_AGAIN_AFTER_S = 0.05
"""How long after a swallowed stop :func:`raise_swallowed_stop_again` sends its signal again: long
enough for the main thread to have left the hook, short against any stop's own time."""

_unraisablehook_before: Any = None
"""The ``sys.unraisablehook`` that :func:`raise_swallowed_stop_again` replaced, for everything else."""


_exiting = False
"""Set by :func:`ignore_stop_signals`: from then on no :class:`StopSignals` installs or restores a handler."""


def ignore_stop_signals() -> None:
    """For a process that is exiting because of a stop signal: a repeated one (schedulers may send
    SIGTERM again) must not kill it halfway through its message or its exit handlers. Final: a
    :class:`StopSignals` leaving its ``with`` afterwards does not put the default (fatal) action back."""
    global _exiting
    if threading.current_thread() is threading.main_thread():
        _exiting = True
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """Hold stop signals off for a block that must finish once begun (stopping a Ray cluster this
    process started: cut short, it leaves agents behind, or Ray removes a node its client is still
    connected to and crashes). The first signal that arrives meanwhile is raised as
    :class:`RunStopped` after the block, unless the block already ends with an exception (a stop
    under way, most often). Outside the main thread, or once the process is exiting on a stop
    (:func:`ignore_stop_signals`), signals are left as they are."""
    if _exiting or threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum)) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        if not _exiting:
            for sig, handler in previous.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    if received:
        raise RunStopped(received[0])


def signal_of(exc: BaseException, signals: StopSignals | None) -> int:
    """The signal behind a KeyboardInterrupt: Ray's waits re-raise a plain KeyboardInterrupt in place of
    :class:`RunStopped`, so the handlers' record is the authority."""
    if signals is not None and signals.received is not None:
        return signals.received
    return getattr(exc, "signum", signal.SIGINT)


STOP_REQUEST_FILE = ".executor_stop"

STOP_RESERVE_S = 5.0
"""Seconds of a step's grace period the driver keeps for itself after the step stopped: the pool's
teardown, the INTERRUPTED record, the lease and a local cluster's shutdown."""


@dataclasses.dataclass(frozen=True)
class StopRequest:
    """The driver asks the step's running attempt to save its work and stop."""

    signal: str
    """The signal the driver received (``SIGTERM``)."""
    budget_s: float
    """Seconds the step has, from reading the request, to save and stop (its grace period less
    :data:`STOP_RESERVE_S`): past them the driver cancels it."""
    at: float
    """When the driver asked (its wall clock)."""


def stop_request_path(step_dir: str) -> str:
    return f"{step_dir.rstrip('/')}/{STOP_REQUEST_FILE}"


def request_stop(step_dir: str, signum: int, budget_s: float) -> None:
    request = StopRequest(signal.Signals(signum).name, max(0.0, float(budget_s)), time.time())
    storage.write_text(stop_request_path(step_dir), json.dumps(dataclasses.asdict(request)))


def read_stop_request(step_dir: str) -> StopRequest | None:
    """The pending stop request of the step at ``step_dir``, or None (also for a foreign, unreadable file)."""
    fields = storage.read_json(stop_request_path(step_dir))
    try:
        return StopRequest(str(fields["signal"]), float(fields["budget_s"]), float(fields["at"]))
    except (TypeError, KeyError, ValueError):
        return None


def clear_stop_request(step_dir: str) -> None:
    """Remove the step's stop request: once the stop is recorded, and before an attempt starts (a
    driver killed while it waited for the step leaves its request behind)."""
    storage.remove(stop_request_path(step_dir))
