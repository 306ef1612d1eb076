"""``marin explain``: for every step of an experiment, would it run, and why.

The reasons compare the plan with what the step directories recorded: no output at this hash,
an earlier failure, which versioned field or upstream step moved the hash, which unversioned
fields differ from the recorded run (reused as they are), and whether the step's code changed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from marin.execution import status as st
from marin.execution import storage
from marin.execution.fingerprint import code_fingerprint, drift
from marin.execution.hashing import key_text
from marin.execution.jsonable import to_jsonable
from marin.execution.plan import Plan, PlannedStep, plan_steps, resolve_config
from marin.execution.prefix import resolve_prefix
from marin.execution.status import StepStatus
from marin.execution.walker import ATTR, GROUP, FieldPath, leaves, path_keys
from marin.review.experiment_file import load_experiment
from marin.review.steps import marked_dirs, step_state


def config_leaves(config: Any) -> list[tuple[str, Any]]:
    """``(field path, value)`` of every leaf of a config, a live one or one recorded as JSON, with
    secrets masked by the one rule (:func:`marin.execution.jsonable.to_jsonable`) and paths spelled
    by the one walker (:mod:`marin.execution.walker`)."""
    return [(str(path), value) for path, value in recorded_leaves(config)]


def is_versioned(path: str, versioned: Iterable[str]) -> bool:
    """Whether a leaf path is (inside) one of the versioned field paths, however either is spelled
    (a recorded config is JSON, where ``model.d_model`` reads ``model["d_model"]``)."""
    keys = path_keys(path)
    return any(keys[:len(v)] == v for v in map(path_keys, versioned))


def unversioned_changes(recorded: Any, current: Any, versioned: Iterable[str]) -> list[str]:
    """Config fields outside the version that differ between the recorded run (JSON) and the
    experiment now (the live config, whose field paths name the change).

    They do not change the hash, so the recorded output is reused as it is: worth saying, since the
    new value has no effect on that step.
    """
    versioned_keys = [path_keys(v) for v in versioned]
    # the live config's spelling (a dataclass field reads model.d_model)
    spelled = {path.keys(): path.describe() for path, _ in leaves(current, key_text)}
    old = {path.keys(): (str(path), v) for path, v in leaves(recorded)}
    new = {path.keys(): (spelled.get(path.keys(), str(path)), v) for path, v in recorded_leaves(current)}
    out = []
    # a field whose shape changed (an element added to lr_replans, a tuple emptied) reads as one
    # change of the whole field, old value -> new value, not as scattered leaves; a field of a nested
    # config (a group, the evaluation config) is a field of its own (optimizer.lr_replans, evaluation.sets)
    current_json = to_jsonable(current)
    configs = {node.parent.keys() for path, _ in leaves(current, key_text) for node in _nodes(path)
               if node.kind in (ATTR, GROUP) and node.parent.parent is not None}
    reshaped = sorted({_field_of(k, configs) for k in set(old) ^ set(new)
                       if k and not any(k[:len(v)] == v for v in versioned_keys)},
                      key=str) if isinstance(recorded, dict) and isinstance(current_json, dict) else []
    for field in reshaped:
        (was, a), (now, b) = _at(recorded, field), _at(current_json, field)
        out.append(_change(spelled.get(field, ".".join(map(str, field))), a, b, was=was, now=now))
    for keys in sorted(set(old) | set(new), key=lambda k: (new.get(k) or old[k])[0]):
        if any(keys[:len(v)] == v for v in versioned_keys) or any(keys[:len(f)] == f for f in reshaped):
            continue
        name, a = old.get(keys, (None, None))
        name, b = new.get(keys, (name, None))
        if keys in old and keys in new and a == b:
            continue
        out.append(_change(name, a, b, was=keys in old, now=keys in new))
    return out


def _at(tree: Any, keys: tuple[Any, ...]) -> tuple[bool, Any]:
    """``(present, value)`` at ``keys`` of a JSON config."""
    for k in keys:
        if not isinstance(tree, dict) or k not in tree:
            return False, None
        tree = tree[k]
    return True, tree


def _nodes(path: FieldPath) -> list[FieldPath]:
    out, node = [], path
    while node is not None:
        out.append(node)
        node = node.parent
    return out


def _field_of(keys: tuple[Any, ...], configs: set[tuple[Any, ...]]) -> tuple[Any, ...]:
    """The field a leaf path belongs to: its first part, or within a nested config that config's field."""
    n = 1
    while n < len(keys) and keys[:n] in configs:
        n += 1
    return keys[:n]


def recorded_leaves(config: Any) -> list[tuple[FieldPath, Any]]:
    """The leaves of a config as it is recorded (JSON, secrets masked), with their paths."""
    return leaves(to_jsonable(config))


def _previous_run(prefix: str, ps: PlannedStep) -> dict[str, Any] | None:
    """Info of the most recent other run of a step with the same name (for hash-change reasons)."""
    candidates: list[tuple[float, dict[str, Any]]] = []
    for step_dir in marked_dirs(f"{prefix}/{ps.name}-*"):
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


def _change(name: str, before: Any, after: Any, *, was: bool, now: bool) -> str:
    """One field's change as ``marin explain`` words it: added, removed, or old -> new."""
    if not was:
        return f"{name} added ({_short(after)})"
    if not now:
        return f"{name} removed (was {_short(before)})"
    return f"{name}: {_short(before)} -> {_short(after)}"


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
                left = [e.rstrip("/").rsplit("/", 1)[-1] for e in storage.list_dir(ps.output_path)]
                left = [n for n in left if not n.startswith((".tmp-", ".write-probe-"))]
                if left:  # a run that stopped before any record was written (or its records were removed)
                    shown = ", ".join(sorted(left)[:5]) + (" ..." if len(left) > 5 else "")
                    reasons.append(f"no status record at this hash, but its directory holds {len(left)} entries "
                                   f"({shown}): the run resumes from what is there")
                else:
                    reasons.append("no previous output at this hash")
                prev = _previous_run(prefix, ps)
                if prev and prev.get("version"):
                    changes = version_changes(prev["version"], ps, plan)
                    reasons.extend(changes or ["hash changed (previous run at " + str(prev.get("output_path")) + ")"])
        if info and "config" in info:
            recorded = info.get("version") or {}
            changed = unversioned_changes(info["config"], resolve_config(ps, plan),
                                          [*(recorded.get("config") or {}), *(recorded.get("spelled") or {}).values()])
            reasons.extend(f"not versioned, reused: {c}" for c in changed)
        if info:
            msg = drift(info.get("code_fingerprint"), code_fingerprint(ps.step.fn))
            if msg:
                warnings.append(f"{msg}; the hash is unchanged, so the recorded output is kept")
        rows.append({"name": ps.name, "hash": ps.hash, "output_path": ps.output_path,
                     "status": status.value if status else "NOT_RUN", "would_run": would_run,
                     "reasons": reasons, "warnings": warnings})
    return rows
