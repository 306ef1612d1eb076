"""The experiment record: what each run of an experiment file did, for review, reports and export.

Layout under the prefix::

    {prefix}/experiments/{script}-{digest}/{run}.json   one file per run of the experiment (written
                                                         only by that run): every step with its
                                                         outcome and version, and the experiment card

``{digest}`` names the set of steps, ``{run}`` the run (UTC start time, host, pid, a random tag).
Readers merge the runs oldest first (:func:`read_experiment_record`). The executor writes a record
at the end of every run (:func:`write_experiment_record`); ``marin status``, the report and export's
lineage read them. Secrets are masked by the one rule of :mod:`marin.execution.jsonable`.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
import uuid
from typing import Any, Protocol

from marin.execution import storage
from marin.execution.fingerprint import code_fingerprint
from marin.execution.hashing import canonical_json, sha256_hex
from marin.execution.jsonable import mask_argv, mask_leaves, mask_text
from marin.execution.outcome import Outcome
from marin.execution.plan import Plan


class RecordedRun(Protocol):
    """What a record says of the run that wrote it (the executor's ``RunOptions`` has these)."""

    script: str
    run_id: str
    description: str | None
    card: dict[str, str] | None


def experiment_record_path(plan: Plan, script: str) -> str:
    """The experiment's record: ``{prefix}/experiments/{script}-{digest}.json`` names it (one name per
    script and set of steps). Each run writes its own file under :func:`experiment_runs_dir`."""
    digest = sha256_hex(canonical_json(sorted(s.digest for s in plan.steps)))[:10]
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.splitext(os.path.basename(script))[0]) or "experiment"
    return f"{plan.prefix}/experiments/{stem}-{digest}.json"


def experiment_runs_dir(record_path: str) -> str:
    """Where each run of the experiment named by ``record_path`` writes its own record.

    One file per run, written only by that run: two drivers running one experiment at once never
    rewrite each other's file, so neither can lose the other's update. That holds on every backend
    with plain whole-file writes; a conditional rewrite of one shared file would need a
    generation match, which gcsfs does not offer for replacing an object."""
    return record_path[: -len(".json")]


def new_run_id() -> str:
    """A run's name among its experiment's records: UTC start time (sorts by time), host, pid, random."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:40]
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def merged_outcomes(previous: dict[str, str | None], outcome: dict[str, str]) -> dict[str, str | None]:
    """Each step's outcome for the record, given what the record said before this run wrote it.

    A step this run found finished ("cached", "reused") keeps "succeeded" when the record has it: the
    report then names the run that produced the output, not the last one that looked at it, and a
    concurrent run that only waited for a step does not overwrite the outcome of the run that ran it.
    A step this run did not consider ("not_selected", "dry_run", none) keeps what the record says."""
    out = dict(previous)
    for path, new in outcome.items():
        old = previous.get(path)
        if new in (Outcome.CACHED, Outcome.REUSED) and old == Outcome.SUCCEEDED:
            continue
        if new in (Outcome.NOT_SELECTED, Outcome.DRY_RUN) and old:
            continue
        out[path] = new
    return out


def read_experiment_record(record_path: str) -> dict[str, Any] | None:
    """The experiment's record as every run so far left it (None when no run wrote one).

    The runs' files are applied oldest first with :func:`merged_outcomes`; the newest run's fields
    (script, card, argv, steps) are kept. A file that does not parse is skipped (it is one run's;
    the others still count)."""
    paths = storage.glob(f"{experiment_runs_dir(record_path)}/*.json")
    records = []
    for path in paths:
        try:
            rec = json.loads(storage.read_text(path) or "null")
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("steps"), list):
            records.append(rec)
    if not records:
        return None
    records.sort(key=lambda r: r.get("updated") or 0)
    outcomes: dict[str, str | None] = {}
    for rec in records:
        this = {s["output_path"]: s.get("outcome") for s in rec["steps"] if isinstance(s, dict) and "output_path" in s}
        outcomes = merged_outcomes(outcomes, {k: v for k, v in this.items() if v})
    newest = records[-1]
    steps = [{**s, "outcome": outcomes.get(s.get("output_path"))} for s in newest["steps"] if isinstance(s, dict)]
    return {**newest, "steps": steps, "runs": len(records)}


def experiment_record_paths(prefix: str) -> list[str]:
    """The record path (see :func:`experiment_record_path`) of every experiment with a record under
    ``prefix``: each has a directory of run files."""
    return sorted({os.path.dirname(p) + ".json" for p in storage.glob(f"{prefix}/experiments/*/*.json")})


def record_steps(plan: Plan) -> list[dict[str, Any]]:
    """Each step of ``plan`` as a record lists it, less its outcome (what each run's write adds):
    the same for every record a run writes, so a run computes it once."""
    return [
        {
            "name": s.name,
            "hash": s.hash,
            "output_path": s.output_path,
            "fn": code_fingerprint(s.step.fn)["fn"],
            "dependencies": [d.output_path for d in s.dependencies + s.nonblocking_dependencies],
            "version": {**s.version(), "config": mask_leaves(s.config_leaves)},
        }
        for s in plan.steps
    ]


def write_experiment_record(plan: Plan, opts: RecordedRun, outcome: dict[str, str],
                            steps: list[dict[str, Any]] | None = None) -> str:
    """Write this run's record (its own file, see :func:`experiment_runs_dir`); returns its path.

    Its outcomes are merged with what earlier runs recorded (:func:`merged_outcomes`), so the newest
    run's file alone reads as the whole experiment; a run writing at the same time is merged in by
    :func:`read_experiment_record`. ``steps``: :func:`record_steps` of ``plan``, if computed already."""
    record_path = experiment_record_path(plan, opts.script)
    path = f"{experiment_runs_dir(record_path)}/{opts.run_id}.json"
    before = read_experiment_record(record_path) or {}
    previous = {s["output_path"]: s.get("outcome") for s in before.get("steps", [])}
    outcome = merged_outcomes(previous, outcome)
    record = {
        "script": opts.script,
        "run": opts.run_id,
        "description": mask_text(opts.description or "") or None,
        "card": {k: mask_text(v) for k, v in opts.card.items()} if opts.card else None,
        "prefix": plan.prefix,
        "updated": time.time(),
        "host": socket.gethostname(),
        "argv": mask_argv(sys.argv),
        "steps": [
            {"name": e["name"], "hash": e["hash"], "output_path": e["output_path"], "fn": e["fn"],
             "outcome": outcome.get(e["output_path"]), "dependencies": e["dependencies"], "version": e["version"]}
            for e in (steps if steps is not None else record_steps(plan))
        ],
    }
    storage.write_text(path, json.dumps(record))  # not indented: see status.record_text
    return path
