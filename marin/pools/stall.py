"""The stall watchdog: a pool whose hosts stop completing steps is killed and relaunched.

A host stuck in a collective (a GPU fault, a deadlock, a stuck NCCL kernel, a process stopped by the
kernel) leaves every other host of the pool waiting for it inside the same collective: nothing fails,
nothing finishes, and the step stays RUNNING with a live lease forever. Upstream Marin added a progress
watchdog to its training loop for exactly this (marin-community/marin PR #7929, with a deadline that
covers startup in PR #8543) after single-rank faults stopped its hero run.

How it works here:

* **Heartbeat.** Every host of a pool reports to a small board (a Ray actor the launcher starts with
  the pool): after each completed step, its step number and how long the step took; before something
  known to be long (compiling a new program, an in-training eval, a checkpoint wait) the name of that
  phase; and, from a background thread, a beat every few seconds that says only "still here". A host
  stopped by SIGSTOP or wedged in the kernel sends nothing at all; a host waiting on a lost peer keeps
  beating from its thread but completes no step.
* **Rule** (:func:`find_stall`, a pure function of what the launcher observed). The pool is stalled
  when no host completed a step for the allowed time: :attr:`StallRule.timeout_s` when set, otherwise
  ``factor`` times the median measured step time, at least ``floor_s``; before the first step of an
  attempt (restore and first compilation) and during a long phase, :attr:`StallRule.startup_s`.
  Times are the launcher's own clock (when it first saw a step number change), so clock skew between
  hosts does not matter.
* **Action** (in :func:`marin.pools.launch`): the launcher names the hosts that were behind
  (silent, or at an older step), records the stall, kills every host and relaunches the pool, which
  resumes from the last checkpoint: a :class:`PoolStalled` is an infrastructure failure.

The timeout is read from the run's config when the pool is launched and is not part of the run's
version: an operator may change it on a live run (relaunching the step keeps its output path).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from marin.execution.failures import InfrastructureFailure
from marin.execution.fieldcheck import check_fields
from marin.execution.versioning import live

logger = logging.getLogger(__name__)

LONG_PHASES = frozenset({"start", "compile", "eval", "checkpoint"})
"""Phases a host announces before work that may take far longer than a step: the startup allowance
applies until the next step completes."""

STEP_TIMES_KEPT = 256
"""Recent step durations the board keeps (the median of these sets the derived timeout)."""


class PoolStalled(InfrastructureFailure):
    """No host of the pool completed a step within the allowed time; the pool was killed and is
    relaunched from its last checkpoint (a hung host is the infrastructure's fault, not the step's)."""


@dataclasses.dataclass(frozen=True)
class StallRule:
    """When a pool counts as stalled.

    ``timeout_s``: seconds without a completed step (None: ``factor`` x the median measured step time,
    at least ``floor_s``). ``startup_s``: the allowance before the first step of an attempt (restore,
    first compilation) and during a long phase a host announced (compiling a new sequence-length
    phase, an in-training eval, waiting for a checkpoint). The defaults follow upstream Marin's
    watchdog: a 15-minute step deadline at the scale of a 20-second hero step would be 45 steps; 10 x
    the median reacts sooner on small runs, the floor keeps a slow storage hiccup from killing a pool.
    """

    timeout_s: float | None = live(
        "when a hung pool is killed and relaunched from its last checkpoint, not what is computed; an operator "
        "tunes it on a live run. None: factor x the median measured step time, at least floor_s", default=None)
    startup_s: float = live(
        "the stall watchdog's allowance before the first step of an attempt (checkpoint restore, compilation) "
        "and during a new phase's compilation, an in-training eval or a checkpoint wait; not what is computed",
        default=3600.0)
    factor: float = live("when a hung pool is killed, not what is computed", default=10.0)
    floor_s: float = live("when a hung pool is killed, not what is computed", default=600.0)

    def __post_init__(self) -> None:
        # timeout_s None: derived from the step time
        check_fields(self, "stall.", {"timeout_s": "> 0", "startup_s": "> 0", "factor": "> 0", "floor_s": "> 0"})

    @property
    def beat_every_s(self) -> float:
        """How often a host says "still here": often enough that a silent host is told apart from a
        waiting one well inside the timeout, rarely enough that the board stays small work (at the
        defaults, 5 s: 176 hosts send about 35 beats a second plus one report per host per step)."""
        shortest = min(self.timeout_s or self.floor_s, self.startup_s)
        return max(0.2, min(5.0, shortest / 10.0))

    @property
    def silent_after_s(self) -> float:
        """A host not heard from for this long is silent (stopped, wedged, gone), not merely waiting."""
        return 3.0 * self.beat_every_s


def step_timeout(rule: StallRule, step_seconds: Sequence[float]) -> float:
    """Seconds without a completed step that count as a stall in steady state: the rule's explicit
    timeout, else ``factor`` x the median of the measured step times, at least ``floor_s`` (the floor
    alone while no step time is known)."""
    if rule.timeout_s is not None:
        return float(rule.timeout_s)
    if not step_seconds:
        return rule.floor_s
    return max(rule.floor_s, rule.factor * statistics.median(step_seconds))


@dataclasses.dataclass(frozen=True)
class HostProgress:
    """What the launcher has seen of one host, on the launcher's clock."""

    process: int
    step: int | None = None  # the last completed step it reported (None: none yet in this attempt)
    phase: str = "start"
    advanced_at: float = 0.0  # when its step number last changed (the attempt's start until then)
    heard_at: float | None = None  # when anything from it last arrived (None: never)
    beats: int = 0  # how many reports the board has from it (a change means it was heard)
    pid: int | None = None
    node: str | None = None

    def describe(self, now: float, silent_after_s: float) -> str:
        where = f"host {self.process}" + (f" (pid {self.pid} on {self.node})" if self.pid is not None else "")
        at = "before its first step" if self.step is None else f"at step {self.step}"
        if self.heard_at is None:
            return f"{where}: never reported"
        quiet = now - self.heard_at
        state = f"silent for {quiet:.0f} s" if quiet > silent_after_s else f"alive, in {self.phase}"
        return f"{where}: {at}, {state}"


@dataclasses.dataclass(frozen=True)
class Stall:
    """A stall the rule found: how long nothing moved, what was allowed, and who was behind."""

    idle_s: float
    allowed_s: float
    last_step: int | None
    behind: tuple[str, ...]  # descriptions of the hosts that held the pool up (silent or at an older step)
    hosts: tuple[str, ...]  # every host's description

    def message(self, pool: str) -> str:
        at = "before the first step" if self.last_step is None else f"after step {self.last_step}"
        who = "; ".join(self.behind) if self.behind else (
            "no host is behind: every host is alive at the same step (a hang inside a collective or a kernel)")
        return (f"pool {pool} stalled: no step completed for {self.idle_s:.0f} s {at} (allowed "
                f"{self.allowed_s:.0f} s); behind: {who}")

    def record(self, pool: str, attempt: int) -> dict[str, Any]:
        return {"time": time.time(), "pool": pool, "attempt": attempt, "idle_s": round(self.idle_s, 1),
                "allowed_s": round(self.allowed_s, 1), "last_step": self.last_step, "behind": list(self.behind),
                "hosts": list(self.hosts)}


def observe(seen: Mapping[int, HostProgress], board: Mapping[int, Mapping[str, Any]], now: float
            ) -> dict[int, HostProgress]:
    """The launcher's view after one look at the board: a host whose report count changed was heard
    now; one whose step number changed advanced now."""
    out = dict(seen)
    for process, report in board.items():
        old = out.get(process, HostProgress(process, advanced_at=now))
        beats = int(report.get("beats", 0))
        if beats == old.beats:
            continue
        step = report.get("step")
        out[process] = dataclasses.replace(
            old, step=step, phase=str(report.get("phase", old.phase)), beats=beats, heard_at=now,
            advanced_at=now if step != old.step else old.advanced_at, pid=report.get("pid"), node=report.get("node"))
    return out


def find_stall(hosts: Sequence[HostProgress], *, num_hosts: int, started_at: float, now: float, rule: StallRule,
               step_seconds: Sequence[float] = ()) -> Stall | None:
    """The stall, if the pool has one at ``now``: no host completed a step within the allowed time.

    ``hosts``: what the launcher has seen (hosts never heard from may be missing); ``started_at``: when
    the attempt's hosts started (the clock before any step). The allowance is the startup one before
    any host's first step and while any host announced a long phase, else :func:`step_timeout`.
    Behind: hosts never heard from, silent ones, and those at an older step than the newest.
    """
    by_process = {h.process: h for h in hosts}
    everyone = [by_process.get(p, HostProgress(p, advanced_at=started_at)) for p in range(num_hosts)]
    stepped = [h for h in everyone if h.step is not None]
    last_progress = max((h.advanced_at for h in stepped), default=started_at)
    long_phase = not stepped or any(h.phase in LONG_PHASES for h in everyone if h.heard_at is not None)
    allowed = rule.startup_s if long_phase else step_timeout(rule, step_seconds)
    idle = now - last_progress
    if idle <= allowed:
        return None
    newest = max((h.step for h in stepped), default=None)
    behind = [h for h in everyone
              if h.heard_at is None or now - h.heard_at > rule.silent_after_s
              or (newest is not None and (h.step is None or h.step < newest))]
    return Stall(idle, allowed, newest, tuple(h.describe(now, rule.silent_after_s) for h in behind),
                 tuple(h.describe(now, rule.silent_after_s) for h in everyone))


def append_stall_record(path: str, record: dict[str, Any]) -> None:
    """Add a stall to the JSON list at ``path`` (the step directory's ``stalls.json``; the launcher is
    its only writer). A record that cannot be written is logged, never a reason to stop the retry."""
    import fsspec  # storage: only when a stall is recorded; the launcher's light import path stays without it

    try:
        fs, fs_path = fsspec.core.url_to_fs(path)
        previous = json.loads(fs.cat_file(fs_path)) if fs.exists(fs_path) else []
        fs.makedirs(fs_path.rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(fs_path, json.dumps([*previous, record], indent=1).encode())
    except Exception as e:  # noqa: BLE001 - the stall itself is already logged and raised
        logger.warning("could not record the stall in %s: %s", path, e)


# ---- the board (a Ray actor) and the hosts' side -----------------------------------------------------
class ProgressBoard:
    """Where the hosts of one pool launch report progress; the launcher reads :meth:`snapshot`.

    A Ray actor with no CPU reservation: one small call per host per step and per beat."""

    def __init__(self) -> None:
        self.hosts: dict[int, dict[str, Any]] = {}
        self.step_seconds: deque[float] = deque(maxlen=STEP_TIMES_KEPT)

    def beat(self, process: int, step: int | None, phase: str, step_s: float | None, pid: int, node: str) -> None:
        entry = self.hosts.setdefault(process, {"beats": 0})
        entry.update(step=step, phase=phase, pid=pid, node=node)
        entry["beats"] += 1
        if step_s is not None and process == 0:  # one host's times: the pool runs in lock step
            self.step_seconds.append(float(step_s))

    def snapshot(self) -> dict[str, Any]:
        return {"hosts": {p: dict(e) for p, e in self.hosts.items()}, "step_seconds": list(self.step_seconds)}


class _Reporter:
    """This process's link to its pool's board (none outside a watched launch: every call is a no-op)."""

    def __init__(self) -> None:
        self.board: Any = None
        self.process = 0
        self.step: int | None = None
        self.phase = "start"
        self.node = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self, board: Any, process: int, beat_every_s: float, node: str) -> None:
        self.stop()
        self.board, self.process, self.node = board, process, node
        self.step, self.phase = None, "start"
        self._stop = threading.Event()
        self._send(None)
        self._thread = threading.Thread(target=self._beat, args=(beat_every_s, self._stop), daemon=True,
                                        name="marin-heartbeat")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._thread, self.board = None, None

    def _beat(self, every_s: float, stop: threading.Event) -> None:
        while not stop.wait(every_s):
            self._send(None)

    def _send(self, step_s: float | None) -> None:
        board = self.board
        if board is None:
            return
        with self._lock:
            step, phase = self.step, self.phase
        try:  # fire and forget: the training loop never waits for the board
            board.beat.remote(self.process, step, phase, step_s, os.getpid(), self.node)
        except Exception as e:  # noqa: BLE001 - a lost board must not fail training; the watchdog then sees silence
            logger.debug("heartbeat not sent: %s", e)

    def step_done(self, step: int, seconds: float) -> None:
        with self._lock:
            # a step that followed a long phase (compilation, restore) is not a measure of the step time
            measured = None if self.phase in LONG_PHASES else seconds
            self.step, self.phase = step, "train"
        self._send(measured)

    def enter(self, phase: str) -> None:
        with self._lock:
            if phase == self.phase:
                return
            self.phase = phase
        self._send(None)


_REPORTER = _Reporter()


def start_reporting(board: Any, process: int, rule: StallRule, node: str = "") -> None:
    """Start this host's heartbeat to ``board`` (the launcher's host actor calls it before the host
    function runs)."""
    _REPORTER.start(board, process, rule.beat_every_s, node)


def stop_reporting() -> None:
    _REPORTER.stop()


def report_step(step: int, seconds: float) -> None:
    """Training completed ``step`` (the number of steps done) in ``seconds``: the heartbeat the
    watchdog measures progress by. A no-op outside a watched pool launch."""
    _REPORTER.step_done(step, seconds)


def report_phase(phase: str) -> None:
    """This host starts something that may take far longer than a step (one of :data:`LONG_PHASES`):
    the watchdog allows the startup time until the next step completes."""
    if phase not in LONG_PHASES:
        raise ValueError(f"unknown long phase {phase!r}; one of {sorted(LONG_PHASES)}")
    _REPORTER.enter(phase)


class ProgressWatch:
    """The launcher's side: one board per pool attempt, looked at every beat, judged by the rule."""

    def __init__(self, rule: StallRule, num_hosts: int) -> None:
        import ray  # Ray: only when a pool is launched; planning reads pool specs without it

        self.rule, self.num_hosts = rule, num_hosts
        self.board = ray.remote(ProgressBoard).options(num_cpus=0, max_restarts=0).remote()
        self.started_at = time.monotonic()
        self.seen: dict[int, HostProgress] = {}
        self.step_seconds: list[float] = []

    def check(self) -> Stall | None:
        """Look at the board once; the stall, if the rule finds one now."""
        import ray  # (the same)

        now = time.monotonic()
        try:
            snap = ray.get(self.board.snapshot.remote(), timeout=max(5.0, self.rule.beat_every_s))
        except Exception as e:  # noqa: BLE001 - a slow board is not the pool's stall; judge on what was seen
            logger.warning("the progress board did not answer (%s); judging on the last reports", e)
            snap = None
        if snap is not None:
            self.seen = observe(self.seen, {int(p): r for p, r in snap["hosts"].items()}, now)
            self.step_seconds = snap["step_seconds"]
        return find_stall(list(self.seen.values()), num_hosts=self.num_hosts, started_at=self.started_at, now=now,
                          rule=self.rule, step_seconds=self.step_seconds)

    def close(self) -> None:
        import ray  # (the same)

        ray.kill(self.board, no_restart=True)
