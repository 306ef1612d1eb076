"""Cutovers: a live run's changes and the gates they rest on.

A change of a live run (a transport switch, a microbatch count, a kernel option) is a live-field change
and a relaunch from the newest checkpoint; ``TrainConfig.cutovers`` records which paired gate
(:mod:`marin.training.gate`) each rests on: the gate step's directory and the candidate. Before a run
starts, :func:`check_cutovers` reads each gate's ``gate.json`` and refuses, in one line, a cutover
whose gate failed, has no verdict yet or does not hold the candidate, unless it is forced; and one
whose gate does not back this run's change (:func:`backing_problem`): a gate of another run's
checkpoint, a checkpoint after the cutover, or a candidate that tested another change than the one
the run makes. A verdict is evidence only for the state it started from and the change it tried.
JAX-free: the trainer's driver and ``marin show`` both read it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import fsspec

from marin.execution.jsonable import to_jsonable
from marin.training.config import Cutover, TrainConfig
from marin.training.gate import GATE_FILE, TRANSPORT


class CutoverRefused(ValueError):
    """A cutover whose gate does not back it (failed, no verdict yet, no such candidate); one line."""


def read_gate(path: str) -> dict[str, Any] | None:
    """A gate step's ``gate.json`` (``path``: the step directory or the file), None when not written."""
    url = path if path.endswith(".json") else f"{path.rstrip('/')}/{GATE_FILE}"
    fs, p = fsspec.core.url_to_fs(url)
    if not fs.exists(p):
        return None
    with fs.open(p) as f:
        return json.load(f)


def _same_path(a: Any, b: Any) -> bool:
    return isinstance(a, str) and isinstance(b, str) and a.rstrip("/") == b.rstrip("/")


def _lineage_problem(cutover: Cutover, doc: Mapping[str, Any], run: Mapping[str, Any]) -> str | None:
    """Why the gate's checkpoint is not this run's state before the cutover (None when it is): the gate
    restored this run's own checkpoint at or before the cutover's step, or the checkpoint of the run
    this one branched from (``init_from``) at or before the branch point, whose history this run shares."""
    gated, at_step = doc.get("run"), doc.get("at_step")
    source = run.get("init_from") if isinstance(run.get("init_from"), Mapping) else {}
    if _same_path(gated, run.get("output_path")):
        if isinstance(at_step, int) and at_step > cutover.step:
            return (f"gated this run's checkpoint at step {at_step}, after the cutover's step {cutover.step}; gate a "
                    "checkpoint at or before the step the change starts at")
        return None
    if _same_path(gated, source.get("run")) and isinstance(at_step, int) and at_step <= int(source.get("step", -1)):
        return None
    return (f"gated {gated} at step {at_step}, which is not this run ({run.get('output_path')}) nor the checkpoint "
            "it branched from; a gate is evidence only for the state it started from")


def _value_at(run: Mapping[str, Any], path: str) -> Any:
    node: Any = run
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


_MISSING = object()


def _change_problem(cutover: Cutover, changes: Mapping[str, Any], run: Mapping[str, Any]) -> str | None:
    """Why the candidate's changes are not the change this run makes at the cutover (None when they
    are): every field the candidate changed holds the candidate's value in this run (the transport
    as a switch at the cutover's step), and a transport switch the run makes at that step is one the
    candidate tested."""
    switches = [(int(s), str(t)) for s, t in ((run.get("parallelism") or {}).get("transport_switches") or [])]
    switch_here = next((t for s, t in switches if s == cutover.step), None)
    for path, value in changes.items():
        if path == TRANSPORT:
            if switch_here != value:
                have = f"switches to {switch_here}" if switch_here else "makes no transport switch"
                return (f"tested transport {value} from its gate's step, but this run {have} at step {cutover.step}")
            continue
        have = _value_at(run, path)
        if have is _MISSING or to_jsonable(have) != to_jsonable(value):
            shown = "no such field" if have is _MISSING else repr(have)
            return f"tested {path}={value!r}, but this run has {path}={shown}"
    if switch_here is not None and TRANSPORT not in changes and cutover.step > 0:
        return f"tested {', '.join(changes) or 'no change'}, but this run's change at step {cutover.step} is a " \
               f"transport switch to {switch_here}"
    return None


def backing_problem(cutover: Cutover, doc: Mapping[str, Any] | None, run: Mapping[str, Any]) -> str | None:
    """Why the gate ``doc`` (its gate.json) does not back ``cutover`` of the run recorded as ``run``
    (its config, as recorded), or None when it does: the gate's checkpoint is this run's lineage
    (:func:`_lineage_problem`) and the candidate's changes are the run's change at the cutover
    (:func:`_change_problem`). None too when the gate has no verdict for the candidate yet (that is
    refused on its own)."""
    arm = ((doc or {}).get("arms") or {}).get(cutover.candidate)
    if not doc or not isinstance(arm, Mapping):
        return None
    return _lineage_problem(cutover, doc, run) or _change_problem(cutover, arm.get("changes") or {}, run)


def cutover_evidence(cutover: Cutover, run: Mapping[str, Any] | TrainConfig | None = None) -> dict[str, Any]:
    """What a cutover rests on: ``{"step", "gate", "candidate", "forced", "verdict", "pass", "changes",
    "at_step", "mismatch"}`` (``pass`` None when the gate has no gate.json yet, or does not hold the
    candidate; ``mismatch``: why the gate does not back the change of ``run``, the run's config or its
    record (:func:`backing_problem`), None when it does or no run was given)."""
    doc = read_gate(cutover.gate)
    arm = ((doc or {}).get("arms") or {}).get(cutover.candidate) or {}
    verdict = arm.get("verdict") or {}
    record = to_jsonable(run) if isinstance(run, TrainConfig) else run
    return {"step": cutover.step, "gate": cutover.gate, "candidate": cutover.candidate, "forced": cutover.forced,
            "pass": verdict.get("pass"), "verdict": verdict.get("line"), "changes": arm.get("changes"),
            "at_step": (doc or {}).get("at_step"),
            "mismatch": backing_problem(cutover, doc, record) if record is not None else None}


def check_cutovers(config: TrainConfig) -> list[dict[str, Any]]:
    """Each of the run's cutovers with its evidence (:func:`cutover_evidence`); refuses, in one line, a
    cutover whose gate failed, has no verdict yet or does not hold the candidate, or whose gate does
    not back this run's change (another run's checkpoint, another change: :func:`backing_problem`),
    unless it is forced (``Cutover(forced=True)``: the record keeps that it was, and ``marin show``
    says so)."""
    out = []
    record = to_jsonable(config)
    for c in config.cutovers:
        ev = cutover_evidence(c, record)
        if (ev["pass"] is not True or ev["mismatch"]) and not c.forced:
            if ev["at_step"] is None:
                why = "has no gate.json yet (run the gate first)"
            elif ev["pass"] is None:
                why = "has no verdict for it (not one of the gate's candidates)"
            elif ev["pass"] is not True:
                why = f"failed: {ev['verdict']}"
            else:
                why = f"does not back this run's change: it {ev['mismatch']}"
            raise CutoverRefused(f"cutover at step {c.step} rests on gate {c.gate} candidate {c.candidate!r}, which "
                                 f"{why}; pass Cutover(..., forced=True) to apply it anyway")
        out.append(ev)
    return out
