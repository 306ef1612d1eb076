"""Reviewing what steps produced: a Python API behind ``marin status | show | explain``.

Everything here reads the files the executor wrote (``.executor_status``, ``.executor_lease``,
experiment records); nothing here starts Ray or runs a step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import runpy
import socket
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

from marin.execution import lease as leases
from marin.execution import status as st
from marin.execution import storage
from marin.execution.fingerprint import code_fingerprint, drift
from marin.execution.jsonable import MASK, is_secret_field, to_jsonable
from marin.execution.main import ExperimentLoaded, capturing
from marin.execution.plan import Plan, PlannedStep, plan_steps, resolve_config
from marin.execution.prefix import resolve_prefix
from marin.execution.status import StepStatus
from marin.execution.step import ExecutorStep


def format_duration(s: float | None) -> str:
    """Seconds as a human reads them in a table: ``42.0s``, ``3.5m``, ``2.1h`` (``-`` when unknown)."""
    if s is None:
        return "-"
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{s / 60:.1f}m"
    return f"{s / 3600:.1f}h"


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


# ------------------------------------------------------------------------------------------- #
# what a step's files say about its state                                                       #
# ------------------------------------------------------------------------------------------- #

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


def step_state(step_dir: str, record: dict | None = None, outcome: str | None = None,
               now: float | None = None) -> StepState:
    """The state of one step directory, judged from its status record, its lease and the run's outcome.

    A RUNNING status is only true while a live holder keeps the lease: a released, expired or
    dead-process lease means the run was interrupted (SIGINT, kill, crash) and the step resumes on the
    next run. Status values this code does not know (a newer executor's) are shown as they are.
    """
    now = time.time() if now is None else now
    record = st.read_status(step_dir) if record is None else record
    lease = leases.read_lease(step_dir)
    status = record["status"] if record else "NOT_RUN"
    holder, age, stale = None, None, True
    if lease is not None and not lease.released:
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
        category = "reused" if outcome == "cached" else "succeeded"
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
            return StepState(status, "running", "RUNNING", holder, age, None)
        why = ("holder " + holder + " is gone") if holder else "no live holder"
        return StepState(status, "interrupted", f"INTERRUPTED ({why})", holder, age,
                         f"the run stopped without finishing this step; {resume}")
    # a status value from a newer executor (INTERRUPTED, ...): show it as written
    category = "interrupted" if "INTERRUPT" in status or "LOST" in status else "not run"
    return StepState(status, category, status, holder if not stale else None, age,
                     resume if category == "interrupted" else None)


def step_dirs(prefix: str) -> list[str]:
    """Every step directory under ``prefix`` (see :data:`status.STEP_FILES`)."""
    if storage.is_local(prefix):
        out = []
        for root, dirs, files in os.walk(prefix):
            if any(m in files for m in st.STEP_FILES):
                out.append(root)
                dirs[:] = []
        return sorted(out)
    return _marked_dirs(f"{prefix}/**")  # one listing of the store for every marker


def _marked_dirs(pattern: str) -> list[str]:
    """The directories matching ``pattern`` that hold a step marker (:data:`status.STEP_FILES`)."""
    found = storage.glob(f"{pattern}/.executor_*")
    return sorted({p.rsplit("/", 1)[0] for p in found if p.rsplit("/", 1)[-1] in st.STEP_FILES})


def train_horizon(config: Any) -> int | None:
    """``train_steps`` (or ``total_steps``) of a training config as recorded, wherever it sits."""
    if not isinstance(config, dict):
        return None
    for key in ("train_steps", "total_steps", "num_train_steps"):
        v = config.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    for v in config.values():
        if isinstance(v, dict):
            found = train_horizon(v)
            if found is not None:
                return found
    return None


def row_for(path: str, name: str | None = None, hash_: str | None = None,
            prefix: str | None = None) -> dict[str, Any]:
    """One status-table row of a step directory; a RUNNING step without a live holder reads INTERRUPTED.

    Without a readable info the name is the directory's path under ``prefix`` less its hash (step
    names may hold ``/``)."""
    record = st.read_status(path)
    base = path.rstrip("/")
    base = base[len(prefix.rstrip("/")) + 1:] if prefix and base.startswith(prefix.rstrip("/") + "/") \
        else base.rsplit("/", 1)[-1]
    if name is None or hash_ is None:
        guessed_name, _, guessed_hash = base.rpartition("-")
        info = st.read_info(path, record) or {}
        if not info and st.current_status(record) == StepStatus.UNREADABLE:
            lease = leases.read_lease(path)
            info = (lease.info if lease else None) or {}
        name = name or info.get("name") or guessed_name
        hash_ = hash_ or info.get("hash") or guessed_hash
    state = step_state(path, record)
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


_read_json = storage.read_json


def step_content(path: str, outputs: list[str]) -> dict[str, Any]:
    """What a step's report files say, for ``marin show``: a health checklist, a mixture's effective
    shares, a token store's document counts and skipped documents, an evaluation's results."""
    out: dict[str, Any] = {}
    if "health.json" in outputs:
        out["health_report"] = _read_json(f"{path}/health.json")
    if "mixture_report.json" in outputs:
        rep = _read_json(f"{path}/mixture_report.json") or {}
        out["mixture_shares"] = [{"start_step": s.get("start_step", 0), "domain_shares": s.get("domain_shares")}
                                 for s in rep.get("stages", [])]
    if "manifest.json" in outputs:
        man = _read_json(f"{path}/manifest.json") or {}
        if "totals" in man:
            out["token_store"] = {
                "totals": man["totals"],
                "skipped_by_source": {n: s["skipped"] for n, s in (man.get("sources") or {}).items()
                                      if s.get("skipped")},
            }
    if "eval.json" in outputs:
        out["eval"] = _read_json(f"{path}/eval.json")
    return out


def show(target: str, prefix: str | None = None) -> dict[str, Any]:
    """Config, version tree, dependencies, outputs, report content and error of one step, from the
    files the executor wrote (``marin.review.show`` adds a training step's health)."""
    path = find_step(target, prefix)
    record = st.read_status(path) or {}
    info = st.read_info(path, record) or {}
    outputs = []
    for entry in storage.list_dir(path):
        base = entry.rstrip("/").rsplit("/", 1)[-1]
        if not base.startswith(".executor") and not base.startswith(".tmp-"):
            outputs.append(base)
    return {
        **row_for(path, info.get("name"), info.get("hash")),
        "health": None,  # filled for training steps by marin.review.show (this package reads files only)
        "horizon": train_horizon(info.get("config")),
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


def config_leaves(value: Any, path: str = "") -> Iterable[tuple[str, Any]]:
    """``(field path, value)`` of every leaf of a JSON config, with the executor's path spelling
    (``model.n_layers``, ``weights["web code"]``, ``stores[0]``); secret-named leaves masked."""
    if isinstance(value, dict) and value:
        for k, v in value.items():
            k = str(k)
            sub = (f"{path}.{k}" if path else k) if k.isidentifier() else f"{path}[{json.dumps(k)}]"
            if is_secret_field(k) and v is not None:
                yield sub, MASK
            else:
                yield from config_leaves(v, sub)
    elif isinstance(value, list) and value:
        for i, v in enumerate(value):
            yield from config_leaves(v, f"{path}[{i}]")
    else:
        yield path, value


def is_versioned(path: str, versioned: Iterable[str]) -> bool:
    """Whether a leaf path is (inside) one of the versioned field paths."""
    return any(path == v or path.startswith((v + ".", v + "[")) for v in versioned)


def unversioned_changes(recorded: Any, current: Any, versioned: Iterable[str]) -> list[str]:
    """Config fields outside the version that differ between the recorded run and the experiment now.

    They do not change the hash, so the recorded output is reused as it is: worth saying, since the
    new value has no effect on that step.
    """
    versioned = list(versioned)
    old, new = dict(config_leaves(recorded)), dict(config_leaves(current))
    out = []
    for path in sorted(set(old) | set(new)):
        if is_versioned(path, versioned) or old.get(path) == new.get(path):
            continue
        if path not in old:
            out.append(f"{path} added ({_short(new[path])})")
        elif path not in new:
            out.append(f"{path} removed (was {_short(old[path])})")
        else:
            out.append(f"{path}: {_short(old[path])} -> {_short(new[path])}")
    return out


def _previous_run(prefix: str, ps: PlannedStep) -> dict[str, Any] | None:
    """Info of the most recent other run of a step with the same name (for hash-change reasons)."""
    candidates: list[tuple[float, dict[str, Any]]] = []
    for step_dir in _marked_dirs(f"{prefix}/{ps.name}-*"):
        if step_dir == ps.output_path or step_dir[len(prefix) + 1:].rpartition("-")[0] != ps.name:
            continue
        info = st.read_info(step_dir)
        if info:
            candidates.append((st.last_started(step_dir), info))
    return max(candidates, key=lambda c: c[0])[1] if candidates else None


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
        info = st.read_info(ps.output_path, record) if record else None
        reasons: list[str] = []
        warnings: list[str] = []
        if status == StepStatus.UNREADABLE:
            would_run = False
            rebuilt, why = st.rebuild_plan(record)
            reasons.append(f"{record['unreadable']}: a run refuses to reuse or recompute it; --repair_records true "
                           f"rebuilds it as {rebuilt.value} ({why})")
        elif status == StepStatus.SUCCESS:
            would_run = False
            reasons.append("already succeeded: output reused")
        else:
            would_run = True
            if status == StepStatus.FAILED:
                reasons.append(f"FAILED earlier ({(info or {}).get('error') or 'see marin show'}); "
                               "needs --force_run_failed")
            elif status == StepStatus.RUNNING:
                state = step_state(ps.output_path, record)
                if state.category == "running":
                    reasons.append(
                        f"running now under {state.lease_holder}; a new run waits for it and reuses its output"
                    )
                else:
                    reasons.append(
                        f"{state.label}: the run stopped before this step finished; resumes under a new lease"
                    )
            elif status == StepStatus.DEP_FAILED:
                reasons.append("a dependency failed in an earlier run")
            elif status is not None:  # a state this code does not name (INTERRUPTED, ...): it did not finish
                reasons.append(f"{status.value} in an earlier run (not finished); resumes under a new lease")
            else:
                reasons.append("no previous output at this hash")
                prev = _previous_run(prefix, ps)
                if prev and prev.get("version"):
                    changes = version_changes(prev["version"], ps, plan)
                    reasons.extend(changes or ["hash changed (previous run at " + str(prev.get("output_path")) + ")"])
        if info and "config" in info:
            changed = unversioned_changes(info["config"], to_jsonable(resolve_config(ps, plan)),
                                          (info.get("version") or {}).get("config") or {})
            reasons.extend(f"not versioned, reused: {c}" for c in changed)
        if info:
            msg = drift(info.get("code_fingerprint"), code_fingerprint(ps.step.fn))
            if msg:
                warnings.append(f"{msg}; the hash is unchanged, so the recorded output is kept")
        rows.append({"name": ps.name, "hash": ps.hash, "output_path": ps.output_path,
                     "status": status.value if status else "NOT_RUN", "would_run": would_run,
                     "reasons": reasons, "warnings": warnings})
    return rows
