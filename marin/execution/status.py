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
import re
import time
from typing import Any

from marin.execution import lease as leases
from marin.execution import storage
from marin.execution.jsonable import mask_text

STATUS_FILE = ".executor_status"
STEP_FILES = (STATUS_FILE, leases.LEASE_FILE)
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
    """The run was stopped by a signal (Ctrl-C, SIGTERM, SIGHUP) while the step ran; not a failure of the step."""
    UNREADABLE = "UNREADABLE"
    """Never written: the status file exists but does not parse (torn by a crash of a store that is
    not atomic, truncated, overwritten by hand). The step may hold finished outputs, so the executor
    neither reuses nor recomputes it without ``--repair_records`` (see :func:`rebuild_record`)."""


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
    StepStatus.UNREADABLE: {StepStatus.SUCCESS, StepStatus.FAILED, StepStatus.INTERRUPTED},  # rebuild_record only
}


def check_transition(old: StepStatus | None, new: StepStatus) -> None:
    """Refuse transitions that would lose information (anything out of SUCCESS, for one).

    RUNNING -> RUNNING is a takeover after the previous holder died mid-step.
    """
    if new not in _ALLOWED[old]:
        raise IllegalTransition(f"status transition {old.value if old else 'none'} -> {new.value} is not allowed")


def read_status(step_dir: str, *, attempts: bool = True) -> dict[str, Any] | None:
    """``{"status": ..., "events": [...]}``, or None when the step never started; a status file that
    does not parse reads as UNREADABLE (see :func:`parse_record`), never as None.

    ``attempts``: include the attempts that the step's lease records and the file does not yet
    (see :func:`with_attempts`); False reads the file alone (the lease's holder, judging what
    happened before its own attempt). A finished step's lease is not read."""
    if attempts:
        return read_status_and_lease(step_dir)[0]
    return parse_record(f"{step_dir}/{STATUS_FILE}", storage.read_text(f"{step_dir}/{STATUS_FILE}"))


def read_status_and_lease(step_dir: str) -> tuple[dict[str, Any] | None, leases.Lease | None | bool]:
    """``(record, lease)``: :func:`read_status` and the lease it read to fold its attempts in, one read
    of each file (one round trip each on an object store), for a reader that judges the lease too
    (``marin status``). ``lease`` is False where the status is final (SUCCESS, UNREADABLE) and the
    lease was not read; None where there is none."""
    record = parse_record(f"{step_dir}/{STATUS_FILE}", storage.read_text(f"{step_dir}/{STATUS_FILE}"))
    if current_status(record) in (StepStatus.SUCCESS, StepStatus.UNREADABLE):
        return record, False
    lease = leases.read_lease(step_dir)
    return with_attempts(record, lease), lease


_HEAD_STATUS = re.compile(r'^\s*\{\s*"status"\s*:\s*"([A-Z_]+)"')


def parse_record(path: str, text: str | None) -> dict[str, Any] | None:
    """The status record in ``text`` (None when there is no file), or an UNREADABLE record saying why.

    An unreadable record is ``{"status": "UNREADABLE", "events": [], "unreadable": why, "head_status":
    ...}``; ``head_status`` is the status its readable start names, if any (the writer puts it first),
    which :func:`rebuild_record` uses. Never read as "not run": the step may have finished."""
    if text is None:
        return None
    why = None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        why = f"{'empty file' if not text.strip() else f'not JSON ({e.msg} at byte {e.pos})'}"
    else:
        if not isinstance(record, dict) or record.get("status") not in StepStatus._value2member_map_ \
                or not isinstance(record.get("events", []), list):
            why = "not a status record (no known status)"
        elif record["status"] == StepStatus.UNREADABLE.value:
            why = "a status record that says UNREADABLE"
        else:
            record.setdefault("events", [])
            return record
    head = _HEAD_STATUS.match(text)
    head_status = head.group(1) if head and head.group(1) in StepStatus._value2member_map_ else None
    return {
        "status": StepStatus.UNREADABLE.value, "events": [],
        "unreadable": f"record unreadable: {path} ({len(text.encode())} bytes, {why})"
                      + (f"; its readable start says {head_status}" if head_status else ""),
        "head_status": head_status,
    }


def rebuild_plan(record: dict[str, Any]) -> tuple[StepStatus, str]:
    """What :func:`rebuild_record` would make of an UNREADABLE record, and why that is safe.

    SUCCESS only where the torn record's own start says SUCCESS (the executor writes SUCCESS after
    the outputs are complete, so they were); FAILED where it says FAILED (the failure still needs a
    look); otherwise INTERRUPTED, which the next run resumes over the outputs already there (as
    after a killed run: a training step continues from its last committed checkpoint)."""
    head = record.get("head_status")
    if head == StepStatus.SUCCESS.value:
        return StepStatus.SUCCESS, ("its readable start says SUCCESS, which is written only after the outputs "
                                    "are complete")
    if head == StepStatus.FAILED.value:
        return StepStatus.FAILED, "its readable start says FAILED; the failure still needs --force_run_failed"
    return StepStatus.INTERRUPTED, "it did not finish as far as can be told; the run resumes it over its outputs"


def rebuild_record(step_dir: str, record: dict[str, Any], *, lease: leases.Lease,
                   info: dict[str, Any] | None) -> dict[str, Any]:
    """Replace an UNREADABLE record (see :func:`rebuild_plan`) under ``lease``, held by the caller;
    the damaged text is kept beside it as ``.executor_status.unreadable`` for a person to look at.
    A rebuilt SUCCESS removes the lease with the write, as a committed SUCCESS does."""
    status, why = rebuild_plan(record)
    path = f"{step_dir}/{STATUS_FILE}"
    damaged = storage.read_text(path)
    if damaged is not None:
        storage.write_text(f"{path}.unreadable", damaged)
    event = {"status": status.value, "time": time.time(), "holder": lease.holder, "token": lease.token,
             "message": f"rebuilt from an unreadable record ({record.get('unreadable')}): {why}"}
    out: dict[str, Any] = {"status": status.value, "events": [event]}
    if info is not None:
        out["info"] = info
    consume = leases.lease_path(step_dir) if status == StepStatus.SUCCESS else None
    storage.write_text(path, record_text(out), consume=consume)
    return out


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
    if current_status(record) == StepStatus.UNREADABLE:
        return record  # nothing to merge into; the damage is what the reader must see
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
        event["message"] = mask_text(message)
    if started is not None:
        event["started"] = started
    events.append(event)
    out = {"status": new.value, "events": events}
    info = info if info is not None else (record or {}).get("info")
    if info is not None:
        out["info"] = masked_info(info)
    storage.write_text(f"{step_dir}/{STATUS_FILE}", record_text(out), consume=consume)
    return out


def record_text(record: dict[str, Any]) -> str:
    """A status record as written: one line of JSON, status first (what :func:`parse_record` reads
    from a torn record's start). Not indented: an indent makes :mod:`json` use its pure-Python encoder,
    four to five times slower, on the write every step's commit waits for; ``marin show`` is the
    readable view."""
    return json.dumps(record, default=repr)


def read_info(step_dir: str, record: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """What the step is (config, version, lineage, code, host, holder; the error of a failed attempt),
    for its latest attempt: from ``record`` (a :func:`read_status` result) when given, else read.
    None before the step first started. Its free text is masked (:func:`masked_info`) whatever wrote it."""
    record = read_status(step_dir) if record is None else record
    info = record.get("info") if record else None
    return masked_info(info) if isinstance(info, dict) else info


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


FREE_TEXT = ("description", "error", "traceback")
"""The fields of a step's info written as given (its config is rendered masked by
:func:`marin.execution.jsonable.to_jsonable`): free text that may quote a URL or a token."""


def masked_info(info: dict[str, Any]) -> dict[str, Any]:
    """``info`` with its free-text fields through :func:`marin.execution.jsonable.mask_text`: every
    writer of a step record goes through :func:`write_status`, so no record holds them in clear, and
    the readers (``marin show``, the report) mask again what an older record holds."""
    return {k: mask_text(v) if k in FREE_TEXT and isinstance(v, str) else v for k, v in info.items()}
