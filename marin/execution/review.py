"""Reviewing what steps produced: a Python API behind ``marin status | show | explain``.

Everything here reads the files the executor wrote (``.executor_status``, ``.executor_lease``,
``.executor_info.json``, experiment records); nothing here starts Ray or runs a step.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import socket
import sys
import time
from typing import Any, Iterator

from marin.execution import lease as leases
from marin.execution import status as st
from marin.execution import storage
from marin.execution.fingerprint import code_fingerprint, drift
from marin.execution.main import ExperimentLoaded, capturing
from marin.execution.plan import Plan, PlannedStep, plan_steps
from marin.execution.prefix import resolve_prefix
from marin.execution.status import StepStatus
from marin.execution.step import ExecutorStep


class ExperimentFileError(FileNotFoundError):
    pass


@contextlib.contextmanager
def _argv(argv: list[str]) -> Iterator[None]:
    old = sys.argv
    sys.argv = argv
    try:
        yield
    finally:
        sys.argv = old


def check_experiment_file(path: str) -> str:
    if not os.path.isfile(path):
        raise ExperimentFileError(
            f"experiment file {path!r} not found (working directory {os.getcwd()}); "
            "pass the path to a Python file that calls executor_main(steps=[...])"
        )
    return os.path.abspath(path)


def load_experiment(path: str) -> tuple[list[ExecutorStep], str | None]:
    """The steps (and description) an experiment file passes to ``executor_main``, without running them.

    The file runs as ``__main__`` with its folder first on ``sys.path``, exactly as ``python FILE`` and
    ``marin run FILE`` run it (so ``from common import ...`` of a sibling module works), and stops at
    its ``executor_main`` call, so its post-run code never runs.
    """
    path = check_experiment_file(path)
    folder = os.path.dirname(path)
    sys.path.insert(0, folder)
    try:
        with _argv([path]), capturing():
            runpy.run_path(path, run_name="__main__")
    except ExperimentLoaded as loaded:
        return loaded.steps, loaded.description
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(folder)
    raise ExperimentFileError(f"{path} never called executor_main(steps=[...]) under __main__")


def step_dirs(prefix: str) -> list[str]:
    """Every step directory under ``prefix`` (those holding a status file)."""
    if storage.is_local(prefix):
        out = []
        for root, dirs, files in os.walk(prefix):
            if st.STATUS_FILE in files:
                out.append(root)
                dirs[:] = []
        return sorted(out)
    return sorted(p.rsplit("/", 1)[0] for p in storage.glob(f"{prefix}/**/{st.STATUS_FILE}"))


def _duration(record: dict | None) -> float | None:
    if not record:
        return None
    events = record["events"]
    starts = [e["time"] for e in events if e["status"] == "RUNNING"]
    if not starts:
        return None
    end = events[-1]["time"] if events[-1]["status"] != "RUNNING" else time.time()
    return end - starts[-1]


def row_for(path: str, name: str | None = None, hash_: str | None = None) -> dict[str, Any]:
    record = st.read_status(path)
    lease = leases.read_lease(path)
    base = path.rstrip("/").rsplit("/", 1)[-1]
    if name is None or hash_ is None:
        guessed_name, _, guessed_hash = base.rpartition("-")
        info = st.read_info(path) or {}
        name = name or info.get("name") or guessed_name
        hash_ = hash_ or info.get("hash") or guessed_hash
    holder = None
    if lease is not None and not lease.released:
        stale = leases.is_stale(lease, time.time(), socket.gethostname())
        holder = f"{lease.holder}{' (stale)' if stale else ''}"
    return {
        "name": name,
        "hash": hash_,
        "status": record["status"] if record else "NOT_RUN",
        "lease_holder": holder,
        "duration_s": _duration(record),
        "output_path": path,
    }


def status_rows(prefix: str | None = None, experiment: str | None = None) -> list[dict[str, Any]]:
    """One row per step: of an experiment file (planned, run or not) or of everything under a prefix."""
    prefix = resolve_prefix(prefix)
    if experiment:
        steps, _ = load_experiment(experiment)
        plan = plan_steps(steps, prefix)
        return [row_for(s.output_path, s.name, s.hash) for s in plan.steps]
    return [row_for(p) for p in step_dirs(prefix)]


def find_step(target: str, prefix: str | None = None) -> str:
    """A step directory from a path, or from a name (latest run of that name under the prefix)."""
    prefix = resolve_prefix(prefix)
    for candidate in (target, f"{prefix}/{target}"):
        if storage.exists(f"{candidate.rstrip('/')}/{st.STATUS_FILE}"):
            return candidate.rstrip("/")
    matches = [p for p in step_dirs(prefix) if p[len(prefix) + 1:].rpartition("-")[0] == target]
    if not matches:
        raise FileNotFoundError(
            f"no step directory {target!r} and no step named {target!r} under {prefix}; "
            "try `marin status --prefix ...` to list steps"
        )
    return max(matches, key=lambda p: (st.read_info(p) or {}).get("start_time") or 0)


def show(target: str, prefix: str | None = None) -> dict[str, Any]:
    """Config, version tree, dependencies, outputs and error of one step."""
    path = find_step(target, prefix)
    info = st.read_info(path) or {}
    record = st.read_status(path) or {}
    outputs = []
    for entry in storage.list_dir(path):
        base = entry.rstrip("/").rsplit("/", 1)[-1]
        if not base.startswith(".executor") and not base.startswith(".tmp-"):
            outputs.append(base)
    health = None
    if "metrics.jsonl" in outputs:  # a training step: summarise its telemetry against healthy ranges
        from marin.monitoring.health import health as run_health
        from marin.training.metrics import read_metrics

        health = run_health(read_metrics(path))
    return {
        **row_for(path, info.get("name"), info.get("hash")),
        "health": health,
        "description": info.get("description"),
        "fn": info.get("fn"),
        "config": info.get("config"),
        "version": info.get("version"),
        "dependencies": info.get("dependencies", []),
        "code_fingerprint": info.get("code_fingerprint"),
        "host": info.get("host"),
        "start_time": info.get("start_time"),
        "end_time": info.get("end_time"),
        "outputs": outputs,
        "error": info.get("error"),
        "traceback": info.get("traceback"),
        "events": record.get("events", []),
    }


def _previous_run(prefix: str, ps: PlannedStep) -> dict[str, Any] | None:
    """Info of the most recent other run of a step with the same name (for hash-change reasons)."""
    best = None
    for info_path in storage.glob(f"{prefix}/{ps.name}-*/{st.INFO_FILE}"):
        step_dir = info_path.rsplit("/", 1)[0]
        if step_dir == ps.output_path or step_dir[len(prefix) + 1:].rpartition("-")[0] != ps.name:
            continue
        info = st.read_info(step_dir)
        if info and (best is None or (info.get("start_time") or 0) > (best.get("start_time") or 0)):
            best = info
    return best


def version_changes(old: dict[str, Any], ps: PlannedStep, plan: Plan) -> list[str]:
    """Human reasons why ``ps``'s version differs from ``old`` (a recorded version dict)."""
    by_digest = {s.digest: s for s in plan.steps}
    old_leaves = old.get("config", {})
    old_deps_by_hash = {v["hash"]: v["name"] for v in old.get("dependencies", {}).values()}
    reasons = []
    for path in sorted(set(old_leaves) | set(ps.config_leaves)):
        a, b = old_leaves.get(path), ps.config_leaves.get(path)
        if a == b:
            continue
        if path not in old_leaves:
            reasons.append(f"versioned field {path} added ({_short(b)})")
        elif path not in ps.config_leaves:
            reasons.append(f"versioned field {path} removed (was {_short(a)})")
        elif isinstance(a, dict) and isinstance(b, dict) and "input" in a and "input" in b:
            up = by_digest.get(b["input"])
            up_name = up.name if up else "?"
            old_hash = a["input"][:10]
            if a.get("subpath") != b.get("subpath"):
                reasons.append(f"input {path} now reads {b.get('subpath')!r} instead of {a.get('subpath')!r}")
            if a["input"] != b["input"]:
                was = old_deps_by_hash.get(old_hash, up_name)
                reasons.append(f"upstream step {up_name} changed (hash {old_hash} -> {b['input'][:10]}), via {path}"
                               + (f" (was {was})" if was != up_name else ""))
        else:
            reasons.append(f"versioned field {path} changed: {_short(a)} -> {_short(b)}")
    return reasons


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) < 80 else text[:77] + "..."


def explain(experiment: str, prefix: str | None = None) -> list[dict[str, Any]]:
    """For every step of an experiment: would it run, and why."""
    prefix = resolve_prefix(prefix)
    steps, _ = load_experiment(experiment)
    plan = plan_steps(steps, prefix)
    rows = []
    for ps in plan.steps:
        record = st.read_status(ps.output_path)
        status = st.current_status(record)
        info = st.read_info(ps.output_path) if record else None
        reasons: list[str] = []
        warnings: list[str] = []
        if status == StepStatus.SUCCESS:
            would_run = False
            reasons.append("already succeeded: output reused")
        else:
            would_run = True
            if status == StepStatus.FAILED:
                reasons.append(f"FAILED earlier ({(info or {}).get('error') or 'see marin show'}); "
                               "needs --force_run_failed")
            elif status == StepStatus.RUNNING:
                reasons.append("interrupted or still running (RUNNING without SUCCESS); resumes under a new lease")
            elif status == StepStatus.DEP_FAILED:
                reasons.append("a dependency failed in an earlier run")
            else:
                reasons.append("no previous output at this hash")
                prev = _previous_run(prefix, ps)
                if prev and prev.get("version"):
                    changes = version_changes(prev["version"], ps, plan)
                    reasons.extend(changes or ["hash changed (previous run at " + str(prev.get("output_path")) + ")"])
        if info:
            msg = drift(info.get("code_fingerprint"), code_fingerprint(ps.step.fn))
            if msg:
                warnings.append(f"{msg}; the hash is unchanged, so the recorded output is kept")
        rows.append({"name": ps.name, "hash": ps.hash, "output_path": ps.output_path,
                     "status": status.value if status else "NOT_RUN", "would_run": would_run,
                     "reasons": reasons, "warnings": warnings})
    return rows
