"""What a step's files say: its state, the status table, one step in full (``marin status | show``).

Everything here reads the files the executor and the steps wrote (``.executor_status``,
``.executor_lease``, a step's report files); nothing here starts Ray or runs a step.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from typing import Any

from marin.execution import lease as leases
from marin.execution import status as st
from marin.execution import storage
from marin.execution.outcome import Outcome
from marin.execution.plan import plan_steps
from marin.execution.prefix import resolve_prefix
from marin.execution.status import StepStatus
from marin.monitoring.health import diverged_at, health
from marin.pools import PLACEMENT_FILE
from marin.review import outputs as step_outputs
from marin.review.experiment_file import load_experiment
from marin.review.gate import cutovers
from marin.training.metrics import read_metrics

CATEGORIES = ("succeeded", "reused", "failed", "running", "interrupted", "not run")
"""How the report colours a step. ``reused``: SUCCESS found from an earlier run, nothing recomputed."""


@dataclasses.dataclass(frozen=True)
class StepState:
    status: str
    """The status file's value (SUCCESS, FAILED, RUNNING, DEP_FAILED, ...) or NOT_RUN."""
    category: str
    """One of :data:`CATEGORIES`."""
    label: str
    """What a person reads: ``SUCCESS``, ``RUNNING``, ``INTERRUPTED (holder gone)``, ..."""
    lease_holder: str | None
    lease_age_s: float | None
    """Seconds since the holder last renewed its lease (heartbeat age)."""
    advice: str | None
    """What to do about it, when something needs doing."""


def step_state(step_dir: str, record: dict | None | bool = False, outcome: str | None = None,
               now: float | None = None, lease: leases.Lease | None | bool = False) -> StepState:
    """The state of one step directory, judged from its status record, its lease and the run's outcome.

    A RUNNING status is only true while a live holder keeps the lease: a released, expired or
    dead-process lease means the run was interrupted (SIGINT, kill, crash) and the step resumes on the
    next run. Status values this code does not know (a newer executor's) are shown as they are.
    ``record`` (None: the step never started) and ``lease`` (None: it has none), when the caller read
    them (:func:`marin.execution.status.read_status_and_lease`), are not read again; the lease is read
    only where the status needs it judged (RUNNING, or a newer executor's value).
    """
    now = time.time() if now is None else now
    if record is False:
        record, lease = st.read_status_and_lease(step_dir)
    status = record["status"] if record else "NOT_RUN"
    if lease is False and status not in ("UNREADABLE", "SUCCESS", "FAILED", "DEP_FAILED", "NOT_RUN"):
        lease = leases.read_lease(step_dir)
    holder, age, stale = None, None, True
    if lease and not lease.released:
        stale = leases.is_stale(lease, now, socket.gethostname())
        holder = lease.holder
        age = max(0.0, now - (lease.expiry - leases.DEFAULT_TTL_S))
    resume = "rerun the experiment (same command) to resume it under a new lease"
    if status == "UNREADABLE":
        rebuilt, why = st.rebuild_plan(record)
        return StepState(status, "failed", "UNREADABLE", None, None,
                         f"{record['unreadable']}; a run refuses this step until its record is repaired: "
                         f"--repair_records true rebuilds it as {rebuilt.value} ({why})")
    if status == "SUCCESS":
        category = "reused" if outcome == Outcome.CACHED else "succeeded"
        return StepState(status, category, status, None, None, None)
    if status in ("FAILED", "DEP_FAILED"):
        advice = ("see the error with `marin show`, fix the cause, then rerun with --retry_failed STEP "
                  "(or --force_run_failed true for every failed step)"
                  if status == "FAILED" else "fix the failed dependency, then rerun")
        return StepState(status, "failed", status, None, None, advice)
    if status == "NOT_RUN":
        return StepState(status, "not run", "NOT_RUN", None, None, None)
    if status == "RUNNING":
        if not stale:
            waiting = unfinished_dependencies(record)
            if waiting:  # submitted behind its upstreams: holds a lease, but its body has not started
                return StepState(status, "running", f"QUEUED (waiting for {', '.join(waiting)})", holder, age, None)
            return StepState(status, "running", "RUNNING", holder, age, None)
        why = ("holder " + holder + " is gone") if holder else "no live holder"
        return StepState(status, "interrupted", f"INTERRUPTED ({why})", holder, age,
                         f"the run stopped without finishing this step; {resume}")
    # a status value from a newer executor (INTERRUPTED, ...): show it as written
    category = "interrupted" if "INTERRUPT" in status or "LOST" in status else "not run"
    return StepState(status, category, status, holder if not stale else None, age,
                     resume if category == "interrupted" else None)


class PrefixIsAFileError(FileNotFoundError):
    """``--prefix`` names a regular file (a FileNotFoundError: the CLI prints it as one line)."""


def check_prefix_is_a_directory(prefix: str) -> None:
    """Refuse a local prefix that is a regular file, with what to pass instead."""
    if storage.is_local(prefix) and os.path.isfile(prefix):
        raise PrefixIsAFileError(
            f"--prefix {prefix} is a file, not a directory of step outputs; pass the directory a run wrote to "
            "(the --prefix it ran with; the default is $MARIN_PREFIX, else ./local_store)")


def unfinished_dependencies(record: dict | None) -> list[str]:
    """Names of the upstream steps a running attempt's info lists that have not succeeded yet (the
    executor submits a step behind its running upstreams, so it holds its lease while it waits)."""
    info = (record or {}).get("info") or {}
    out = []
    for dep in info.get("dependencies") or []:
        if st.current_status(st.read_status(dep, attempts=False)) != StepStatus.SUCCESS:
            base = dep.rstrip("/").rsplit("/", 1)[-1]
            out.append(base.rpartition("-")[0] or base)
    return out


def step_dirs(prefix: str) -> list[str]:
    """Every step directory under ``prefix`` (see :data:`status.STEP_FILES`)."""
    check_prefix_is_a_directory(prefix)
    if storage.is_local(prefix):
        out = []
        for root, dirs, files in os.walk(prefix):
            if any(m in files for m in st.STEP_FILES):
                out.append(root)
                dirs[:] = []
        return sorted(out)
    return marked_dirs(f"{prefix}/**")  # one listing of the store for every marker


def marked_dirs(pattern: str) -> list[str]:
    """The directories matching ``pattern`` that hold a step marker (:data:`status.STEP_FILES`)."""
    found = storage.glob(f"{pattern}/.executor_*")
    return sorted({p.rsplit("/", 1)[0] for p in found if p.rsplit("/", 1)[-1] in st.STEP_FILES})


TRAIN_STEPS_KEYS = ("train_steps", "num_train_steps")
"""The fields that give a training config its own horizon (a step that only reads a run, such as a
health report, names the run's horizon ``total_steps``)."""


def train_horizon(config: Any, keys: tuple[str, ...] = ("train_steps", "total_steps", "num_train_steps")
                  ) -> int | None:
    """The first of ``keys`` (``train_steps``, or ``total_steps``) of a config as recorded, wherever it sits."""
    if not isinstance(config, dict):
        return None
    for key in keys:
        v = config.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    for v in config.values():
        if isinstance(v, dict):
            found = train_horizon(v, keys)
            if found is not None:
                return found
    return None


def row_for(path: str, name: str | None = None, hash_: str | None = None,
            prefix: str | None = None) -> dict[str, Any]:
    """One status-table row of a step directory; a RUNNING step without a live holder reads INTERRUPTED.

    Without a readable info the name is the directory's path under ``prefix`` less its hash (step
    names may hold ``/``)."""
    record, lease = st.read_status_and_lease(path)  # one read of each: what an object store charges per step
    base = path.rstrip("/")
    base = base[len(prefix.rstrip("/")) + 1:] if prefix and base.startswith(prefix.rstrip("/") + "/") \
        else base.rsplit("/", 1)[-1]
    if name is None or hash_ is None:
        guessed_name, _, guessed_hash = base.rpartition("-")
        info = st.read_info(path, record or {}) or {}
        if not info and st.current_status(record) == StepStatus.UNREADABLE:
            lease = leases.read_lease(path)  # not read with the status: an unreadable one is final
            info = (lease.info if lease else None) or {}
        name = name or info.get("name") or guessed_name
        hash_ = hash_ or info.get("hash") or guessed_hash
    state = step_state(path, record, lease=lease)
    duration, start, end = st.attempt_times(record)
    holder = state.lease_holder
    if holder and state.category == "interrupted":
        holder += " (stale)"
    return {
        "name": name,
        "hash": hash_,
        "status": state.status,
        "label": state.label,
        "category": state.category,
        "lease_holder": holder,
        "lease_age_s": state.lease_age_s,
        "advice": state.advice,
        "duration_s": duration,
        "start_time": start,
        "end_time": end,
        "output_path": path,
    }


def placement_lines(path: str, running: bool, now: float | None = None) -> list[str]:
    """What a pool step's launcher noted (see :class:`marin.pools.PlacementNote`): the
    reservation it waits for and who holds it (while the step runs), the nodes left out because
    a host of the step failed there, and how often the start-up rendezvous failed (with the hosts
    that never joined, the last time). None for a step without a pool, at the cost of one read."""
    note = storage.read_json(f"{path.rstrip('/')}/{PLACEMENT_FILE}")
    if not isinstance(note, dict):
        return []
    lines = []
    waiting = note.get("waiting")
    if running and isinstance(waiting, dict):
        since = max(0.0, (time.time() if now is None else now) - float(waiting.get("since") or 0))
        held = ", ".join(waiting.get("held_by") or []) or "nothing known to Ray yet"
        lines.append(f"waiting for {waiting.get('for')}: held by {held} (for {since:.0f} s)")
    bad = note.get("bad_nodes") or []
    if bad:
        lines.append("hosts failed on node(s) " + ", ".join(
            f"{n.get('node_id', '?')[:12]} ({n.get('ip', '?')}, {n.get('why', '')})" for n in bad))
    rendezvous = note.get("rendezvous_failures") or []
    if rendezvous:
        last = sorted(rendezvous[-1].get("never_joined") or [], key=lambda m: bool(m.get("reached")))  # culprits first
        lines.append(f"start-up rendezvous failed {len(rendezvous)} time(s); the last time, never joined: " + "; ".join(
            f"host {m.get('host')} ({m.get('ip', '?')}: {m.get('why', '')})" for m in last))
    return lines


def status_rows(prefix: str | None = None, experiment: str | None = None) -> list[dict[str, Any]]:
    """One row per step: of an experiment file (planned, run or not) or of everything under a prefix."""
    prefix = resolve_prefix(prefix)
    if experiment:
        steps, _ = load_experiment(experiment)
        plan = plan_steps(steps, prefix)
        return [row_for(s.output_path, s.name, s.hash) for s in plan.steps]
    return [row_for(p, prefix=prefix) for p in step_dirs(prefix)]


def describe_prefix(prefix: str | None = None) -> str:
    """Why a prefix shows no steps: whether it exists, and what it holds instead."""
    prefix = resolve_prefix(prefix)
    check_prefix_is_a_directory(prefix)
    if not storage.exists(prefix):
        return (f"no steps: {prefix} does not exist (run an experiment with --prefix {prefix}, or pass the "
                "--prefix it ran with; the default is $MARIN_PREFIX, else ./local_store)")
    entries = [e.rstrip("/").rsplit("/", 1)[-1] for e in storage.list_dir(prefix)]
    if not entries:
        return f"no steps: {prefix} exists and is empty"
    shown = ", ".join(sorted(entries)[:10]) + (f" and {len(entries) - 10} more" if len(entries) > 10 else "")
    return (f"no steps: {prefix} exists but holds no step directory (none has a {' or '.join(st.STEP_FILES)} file); "
            f"it holds {len(entries)} entries: {shown}")


def find_step(target: str, prefix: str | None = None) -> str:
    """A step directory from a path, or from a name (latest run of that name under the prefix)."""
    prefix = resolve_prefix(prefix)
    for candidate in (target, f"{prefix}/{target}"):
        if any(storage.exists(f"{candidate.rstrip('/')}/{m}") for m in st.STEP_FILES):
            return candidate.rstrip("/")
    matches = [p for p in step_dirs(prefix) if p[len(prefix) + 1:].rpartition("-")[0] == target]
    if not matches:
        raise FileNotFoundError(
            f"no step directory {target!r} and no step named {target!r} under {prefix}; "
            "try `marin status --prefix ...` to list steps"
        )
    return max(matches, key=st.last_started)


def step_content(path: str, outputs: list[str]) -> dict[str, Any]:
    """What a step's output files say (:data:`marin.review.outputs.OUTPUTS`; ``outputs``: the files the
    step has), for ``marin show``: each under its key, as much as the table keeps of it."""
    out: dict[str, Any] = {}
    for o in step_outputs.OUTPUTS:
        if o.file in outputs and o.key not in out:
            data = storage.read_json(f"{path}/{o.file}")
            if o.accept(data):
                out[o.key] = o.keep(data)
    return out


def show(target: str, prefix: str | None = None) -> dict[str, Any]:
    """What ``marin show`` prints: config, version tree, dependencies, outputs, report content and
    error of one step, from the files the executor wrote; for a training step (one that wrote
    ``metrics.jsonl``) also its telemetry against healthy ranges."""
    path = find_step(target, prefix)
    record = st.read_status(path) or {}
    info = st.read_info(path, record) or {}
    outputs = []
    entries = [e.rstrip("/").rsplit("/", 1)[-1] for e in storage.list_dir(path)]
    for base in entries:
        if not base.startswith(".executor") and not base.startswith(".tmp-") and base != PLACEMENT_FILE:
            outputs.append(base)
    placed = PLACEMENT_FILE in entries
    return {
        "placement": placement_lines(path, running=st.current_status(record) == StepStatus.RUNNING) if placed else [],
        **row_for(path, info.get("name"), info.get("hash")),
        "health": _health(path, outputs, info.get("config"), info.get("error")),
        "horizon": train_horizon(info.get("config")),
        "cutovers": cutovers(info.get("config")),
        "content": step_content(path, outputs),
        "description": info.get("description"),
        "fn": info.get("fn"),
        "config": info.get("config"),
        "version": info.get("version"),
        "dependencies": info.get("dependencies", []),
        "code_fingerprint": info.get("code_fingerprint"),
        "host": info.get("host"),
        "outputs": outputs,
        "error": info.get("error"),
        "traceback": info.get("traceback"),
        "events": record.get("events", []),
    }


def _health(path: str, outputs: list[str], config: Any, error: str | None) -> dict[str, Any] | None:
    """A training step's telemetry against healthy ranges (None for a step without metrics.jsonl); a
    step whose error is the trainer's NaN/Inf guard reads as diverged."""
    if "metrics.jsonl" not in outputs:
        return None
    found = diverged_at(error)
    return health(read_metrics(path), train_horizon(config), diverged=found[1] if found else None)
