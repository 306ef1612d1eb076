"""A step's record: ``.executor_status`` (state, event history, and what the step is).

The status file is written only by the holder of the step's lease (see :mod:`lease`), so a plain
atomic replace is enough. SUCCESS is written last, after the step's outputs are complete: a step
directory without SUCCESS is never read as finished.

``{"status", "events", "info"}``: ``info`` says what the step is (config, version, lineage, code,
host, holder), plus the error of a failed attempt; when an attempt started and ended is in the
events only (:func:`attempt_times`).

An attempt's start is not written here: the held lease records it (holder, token, since, info), and
:func:`read_status` shows it as a RUNNING event; the attempt's first write (SUCCESS, FAILED, ...)
puts that event and the info in the file. Starting a step is therefore one write (the lease), and
on local disk the SUCCESS commit turns the lease's file into the status file: one file created per
step. On some disks creating a file is most of a bookkeeping write's cost, and on object stores
every write is a round trip (see docs/performance.md). Every event carries the lease token it was
written under, so an attempt is never shown twice.
"""

from __future__ import annotations

import enum
import json
import time
from typing import Any

from marin.execution import lease as leases
from marin.execution import storage

STATUS_FILE = ".executor_status"
LEGACY_INFO_FILE = ".executor_info.json"
"""Where executors before the one-file record wrote the info; still read for their steps."""
STEP_FILES = (STATUS_FILE, leases.LEASE_FILE, LEGACY_INFO_FILE)
"""A directory holding any of these is a step directory (a first attempt in progress has no status
file yet: its lease records it)."""


class StepStatus(str, enum.Enum):
    """A step's state. Only SUCCESS means finished; the next run resumes every other state except
    FAILED, which needs ``--force_run_failed`` (a failure deserves a look first)."""

    RUNNING = "RUNNING"
    SUCCESS = "SUCCESS"
    FAILED = "FAILED"
    DEP_FAILED = "DEP_FAILED"
    INTERRUPTED = "INTERRUPTED"
    """The run was stopped by the user (Ctrl-C) while the step ran; not a failure of the step."""


class IllegalTransition(RuntimeError):
    pass


_ALLOWED: dict[StepStatus | None, set[StepStatus]] = {
    None: {StepStatus.RUNNING, StepStatus.DEP_FAILED},
    StepStatus.RUNNING: {
        StepStatus.RUNNING, StepStatus.SUCCESS, StepStatus.FAILED, StepStatus.DEP_FAILED, StepStatus.INTERRUPTED,
    },
    StepStatus.INTERRUPTED: {StepStatus.RUNNING, StepStatus.DEP_FAILED},
    StepStatus.FAILED: {StepStatus.RUNNING, StepStatus.DEP_FAILED},  # RUNNING only with --force_run_failed
    StepStatus.DEP_FAILED: {StepStatus.RUNNING, StepStatus.DEP_FAILED},
    StepStatus.SUCCESS: set(),
}


def check_transition(old: StepStatus | None, new: StepStatus) -> None:
    """Refuse transitions that would lose information (anything out of SUCCESS, for one).

    RUNNING -> RUNNING is a takeover after the previous holder died mid-step.
    """
    if new not in _ALLOWED[old]:
        raise IllegalTransition(f"status transition {old.value if old else 'none'} -> {new.value} is not allowed")


def read_status(step_dir: str, *, attempts: bool = True) -> dict[str, Any] | None:
    """``{"status": ..., "events": [...]}`` or None when the step never started.

    ``attempts``: include the attempts that the step's lease records and the file does not yet
    (see :func:`with_attempts`); False reads the file alone (the lease's holder, judging what
    happened before its own attempt). A finished step's lease is not read."""
    record = storage.read_json(f"{step_dir}/{STATUS_FILE}")  # damaged: read as never started
    if not attempts or current_status(record) == StepStatus.SUCCESS:
        return record
    return with_attempts(record, leases.read_lease(step_dir))


def _recorded(events: list[dict[str, Any]], attempt: leases.Attempt) -> bool:
    """Whether an event was written under ``attempt`` (events of executors that wrote no token match
    by holder, which is unique to one process)."""
    holder, token, _ = attempt
    return any(e.get("holder") == holder and e.get("token", token) == token for e in events)


def with_attempts(
    record: dict[str, Any] | None, lease: leases.Lease | None, *, own: bool = True
) -> dict[str, Any] | None:
    """``record`` with a RUNNING event for each attempt ``lease`` records that no event records yet.

    Those are the attempts of holders that died holding the lease (``lease.abandoned``) and, while
    the lease is held, its holder's own attempt (``own=False`` leaves it out: the holder took the
    lease without starting the step), which makes the step RUNNING with the lease's info. A
    released lease adds nothing: its holder wrote what it did before releasing."""
    if lease is None or lease.released:
        return record
    events = list(record["events"]) if record else []
    attempts = (*lease.abandoned, lease.attempt) if own else lease.abandoned
    new = [
        {"status": StepStatus.RUNNING.value, "time": since, "holder": holder, "token": token}
        for holder, token, since in attempts
        if not _recorded(events, (holder, token, since))
    ]
    if not new:
        return record
    merged = {**(record or {}), "status": StepStatus.RUNNING.value, "events": events + new}
    if own and lease.info is not None:
        merged["info"] = lease.info
    return merged


def current_status(record: dict[str, Any] | None) -> StepStatus | None:
    return StepStatus(record["status"]) if record else None


def write_status(
    step_dir: str, new: StepStatus, *, lease: leases.Lease, message: str | None = None,
    previous: dict | None = None, started: float | None = None, consume: str | None = None,
    info: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Append an event written under ``lease`` (held by the caller) and set the status.

    ``previous``: the record to append to, attempts included, if already read; by default the file
    and ``lease``'s attempts (the caller's lease is the step's current one, so it is not read
    again). ``started`` (on a finishing event) is when the step's body began on its worker: a step
    submitted behind its upstreams is RUNNING while it waits in Ray's queue, and its duration counts
    from this instead. ``consume``: a file of the step to remove with this write (see
    :func:`storage.write_text`). ``info`` replaces the record's info (a failure adds its error); by
    default the attempt's info is kept."""
    record = previous if previous is not None else with_attempts(read_status(step_dir, attempts=False), lease)
    check_transition(current_status(record), new)
    events = list(record["events"]) if record else []
    event = {"status": new.value, "time": time.time(), "holder": lease.holder, "token": lease.token}
    if message:
        event["message"] = message
    if started is not None:
        event["started"] = started
    events.append(event)
    out = {"status": new.value, "events": events}
    info = info if info is not None else (record or {}).get("info")
    if info is not None:
        out["info"] = info
    storage.write_text(f"{step_dir}/{STATUS_FILE}", json.dumps(out, indent=1, default=repr), consume=consume)
    return out


def read_info(step_dir: str, record: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """What the step is (config, version, lineage, code, host, holder; the error of a failed attempt),
    for its latest attempt: from ``record`` (a :func:`read_status` result) when given, else read.
    None before the step first started."""
    record = read_status(step_dir) if record is None else record
    if record and record.get("info") is not None:
        return record["info"]
    return storage.read_json(f"{step_dir}/{LEGACY_INFO_FILE}")


def attempt_times(
    record: dict[str, Any] | None, now: float | None = None
) -> tuple[float | None, float | None, float | None]:
    """``(duration, start, end)`` of the latest attempt in a status record (None where unknown).

    The start is the attempt's RUNNING event or, once it finished, the time its body began on the
    worker when the finishing event records it (see :func:`write_status`); a running attempt's
    duration runs to ``now``."""
    if not record or not record.get("events"):
        return None, None, None
    events = record["events"]
    starts = [e["time"] for e in events if e["status"] == StepStatus.RUNNING.value]
    if not starts:
        return None, None, None
    last = events[-1]
    if last["status"] == StepStatus.RUNNING.value:
        return (time.time() if now is None else now) - starts[-1], starts[-1], None
    start = last.get("started", starts[-1])
    return last["time"] - start, start, last["time"]


def last_started(step_dir: str) -> float:
    """When the step's latest attempt started (0 if it never did): orders runs of one step name."""
    return attempt_times(read_status(step_dir))[1] or 0.0
