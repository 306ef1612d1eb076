"""Cutovers: a live run's changes and the gates they rest on.

A change of a live run (a transport switch, a microbatch count, a kernel option) is a live-field change
and a relaunch from the newest checkpoint; ``TrainConfig.cutovers`` records which paired gate
(:mod:`marin.training.gate`) each rests on: the gate step's directory and the candidate. Before a run
starts, :func:`check_cutovers` reads each gate's ``gate.json`` and refuses, in one line, a cutover
whose gate failed, has no verdict yet or does not hold the candidate, unless it is forced. JAX-free:
the trainer's driver and ``marin show`` both read it.
"""

from __future__ import annotations

import json
from typing import Any

import fsspec

from marin.training.config import Cutover, TrainConfig
from marin.training.gate import GATE_FILE


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


def cutover_evidence(cutover: Cutover) -> dict[str, Any]:
    """What a cutover rests on: ``{"step", "gate", "candidate", "forced", "verdict", "pass", "changes"}``
    (``pass`` None when the gate has no gate.json yet, or does not hold the candidate)."""
    doc = read_gate(cutover.gate)
    arm = ((doc or {}).get("arms") or {}).get(cutover.candidate) or {}
    verdict = arm.get("verdict") or {}
    return {"step": cutover.step, "gate": cutover.gate, "candidate": cutover.candidate, "forced": cutover.forced,
            "pass": verdict.get("pass"), "verdict": verdict.get("line"), "changes": arm.get("changes"),
            "at_step": (doc or {}).get("at_step")}


def check_cutovers(config: TrainConfig) -> list[dict[str, Any]]:
    """Each of the run's cutovers with its evidence (:func:`cutover_evidence`); refuses, in one line, a
    cutover whose gate failed, has no verdict yet or does not hold the candidate, unless it is forced
    (``Cutover(forced=True)``: the record keeps that it was)."""
    out = []
    for c in config.cutovers:
        ev = cutover_evidence(c)
        if ev["pass"] is not True and not c.forced:
            if ev["at_step"] is None:
                why = "has no gate.json yet (run the gate first)"
            elif ev["pass"] is None:
                why = "has no verdict for it (not one of the gate's candidates)"
            else:
                why = f"failed: {ev['verdict']}"
            raise CutoverRefused(f"cutover at step {c.step} rests on gate {c.gate} candidate {c.candidate!r}, which "
                                 f"{why}; pass Cutover(..., forced=True) to apply it anyway")
        out.append(ev)
    return out
