"""Review an experiment from Python (a notebook, a script): steps, configs, metrics, files, results.

    import marin.review as mr

    exp = mr.load("experiments/quickstart.py", prefix="local_store")   # or mr.load(prefix="local_store")
    for step in exp.steps:
        print(step.name, step.status, step.duration_s, step.output_path)
    train = exp.step("quickstart/train-tiny-moe")
    table = train.metrics()            # a pyarrow.Table; .to_pandas() where pandas is installed
    exp.step("quickstart/health").health()   # the health checklist as a dict

Everything here reads the files the executor and the steps wrote; nothing starts Ray or runs a step.
The same objects feed ``marin report`` (:func:`marin.review.report.write_report`).

The package holds everything a person uses to look at outputs, one module per concern:

    steps.py            a step's state, the status table, one step in full  (marin status, marin show)
    explain.py          would each step run, and why                          (marin explain)
    experiment_file.py  load an experiment file's steps without running them
    live.py             the refreshing status screen                          (marin watch)
    report.py, dag.py, plots.py   the self-contained HTML report              (marin report)
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from typing import Any

from marin.execution import status as st
from marin.execution import storage
from marin.execution.experiment_record import experiment_record_path, experiment_record_paths, read_experiment_record
from marin.execution.jsonable import mask_leaves, to_jsonable
from marin.execution.plan import plan_steps, resolve_config
from marin.execution.prefix import resolve_prefix
from marin.review.experiment_file import load_experiment_card
from marin.review.explain import explain
from marin.review.steps import (
    CATEGORIES,
    StepState,
    check_prefix_is_a_directory,
    show,
    status_rows,
    step_dirs,
    step_state,
    train_horizon,
)

__all__ = ["CATEGORIES", "Experiment", "Step", "StepState", "explain", "load", "load_file", "load_prefix", "show",
           "status_rows", "step_state"]

# --------------------------------------------------------------------------------------------- #
# steps                                                                                            #
# --------------------------------------------------------------------------------------------- #


class Step:
    """One step's directory: its identity, status, config and outputs (read lazily, cached)."""

    def __init__(self, output_path: str, *, name: str | None = None, hash: str | None = None,
                 outcome: str | None = None, dependencies: list[str] | None = None,
                 version: dict | None = None, planned_config: Any = None) -> None:
        self.output_path = output_path.rstrip("/")
        self._name, self._hash = name, hash
        self.outcome = outcome
        """This run's outcome from the experiment record (cached, succeeded, failed, ...), if any."""
        self._dependencies = dependencies
        self._version = version
        self._planned_config = planned_config
        self._info: dict | None | bool = False
        self._record: dict | None | bool = False
        self._state: StepState | None = None

    def __repr__(self) -> str:
        return f"Step({self.name}-{self.hash}, {self.status})"

    # identity ---------------------------------------------------------------------------------- #
    @property
    def info(self) -> dict[str, Any]:
        """What the step is: config, version, lineage, code, host; the error of a failed attempt
        (empty before the step first started)."""
        if self._info is False:
            self._info = st.read_info(self.output_path, self.status_record)
        return self._info or {}

    @property
    def name(self) -> str:
        return self._name or self.info.get("name") or self.output_path.rsplit("/", 1)[-1].rpartition("-")[0]

    @property
    def hash(self) -> str:
        return self._hash or self.info.get("hash") or self.output_path.rsplit("/", 1)[-1].rpartition("-")[2]

    @property
    def dependencies(self) -> list[str]:
        """Output paths of the steps this one reads."""
        if self._dependencies is not None:
            return self._dependencies
        return list(self.info.get("dependencies") or [])

    @property
    def fn(self) -> str | None:
        return self.info.get("fn")

    @property
    def description(self) -> str | None:
        return self.info.get("description")

    # status ------------------------------------------------------------------------------------ #
    @property
    def status_record(self) -> dict[str, Any] | None:
        if self._record is False:
            self._record = st.read_status(self.output_path)
        return self._record or None

    @property
    def state(self) -> StepState:
        if self._state is None:
            self._state = step_state(self.output_path, self.status_record or {}, self.outcome) \
                if self.status_record else step_state(self.output_path, None, self.outcome)
        return self._state

    @property
    def status(self) -> str:
        """SUCCESS, FAILED, RUNNING, DEP_FAILED, NOT_RUN, or a newer executor's value."""
        return self.state.status

    @property
    def duration_s(self) -> float | None:
        return st.attempt_times(self.status_record)[0]

    @property
    def start_time(self) -> float | None:
        return st.attempt_times(self.status_record)[1]

    @property
    def end_time(self) -> float | None:
        return st.attempt_times(self.status_record)[2]

    @property
    def error(self) -> str | None:
        return self.info.get("error")

    @property
    def traceback(self) -> str | None:
        return self.info.get("traceback")

    # config ------------------------------------------------------------------------------------ #
    @property
    def config(self) -> Any:
        """The resolved config as recorded when the step ran (secrets masked), else as planned."""
        if "config" in self.info:
            return self.info["config"]
        return self._planned_config

    @property
    def version(self) -> dict[str, Any]:
        """What the hash is made of: ``{"config": {field path: value}, "dependencies": {...}, ...}``."""
        return self.info.get("version") or self._version or {}

    @property
    def versioned_fields(self) -> dict[str, Any]:
        return dict(self.version.get("config") or {})

    # outputs ----------------------------------------------------------------------------------- #
    def files(self) -> list[tuple[str, int | None]]:
        """``(relative path, size in bytes)`` of the step's outputs (executor files left out); a
        directory is listed with its total size."""
        out = []
        if not storage.exists(self.output_path):
            return out
        if storage.is_local(self.output_path):
            for entry in sorted(os.scandir(self.output_path), key=lambda e: e.name):
                if entry.name.startswith((".executor", ".tmp-")):
                    continue
                out.append((entry.name + ("/" if entry.is_dir() else ""), _size(entry.path)))
            return out
        for entry in storage.list_dir(self.output_path):
            base = entry.rstrip("/").rsplit("/", 1)[-1]
            if not base.startswith((".executor", ".tmp-")):
                out.append((base, None))
        return out

    def read_json(self, name: str) -> Any:
        """A JSON output of the step, or None when it is absent (or not JSON)."""
        return storage.read_json(f"{self.output_path}/{name}")

    def metric_records(self) -> list[dict[str, Any]]:
        """Every record of the step's ``metrics.jsonl`` (training and eval records), in file order."""
        text = storage.read_text(f"{self.output_path}/metrics.jsonl")
        if not text:
            return []
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def metrics(self, kind: str | None = "train") -> Any:
        """The step's ``metrics.jsonl`` as a ``pyarrow.Table`` (one row per record, one column per key).

        ``kind="train"`` keeps training records, ``"eval"`` the evaluation records (``"kind": "eval"``),
        None keeps all. Needs pyarrow (``pip install 'marin[data]'``).
        """
        try:
            import pyarrow as pa  # pyarrow: the data extra, only for a table of metrics
        except ImportError:
            raise ImportError("Step.metrics() needs pyarrow: pip install 'marin[data]'") from None
        rows = self.metric_records()
        if kind is not None:
            rows = [r for r in rows if r.get("kind", "train") == kind]
        keys: dict[str, None] = {}
        for r in rows:
            keys.update(dict.fromkeys(r))
        return pa.table({k: [r.get(k) for r in rows] for k in keys})

    def health(self) -> dict[str, Any] | None:
        """The health checklist (``health.json``) of a health step, or None."""
        return self.read_json("health.json")

    def eval_results(self) -> dict[str, Any] | None:
        """Evaluation results (``eval.json``: per-set documents, tokens, loss, bpb; macro/micro bpb), or None."""
        return self.read_json("eval.json")

    def ladder_fit(self) -> dict[str, Any] | None:
        """A scaling-ladder fit (``fit.json``: target, predictions with bands, parameters), or None."""
        return self.read_json("fit.json")

    def isoflop_fit(self) -> dict[str, Any] | None:
        """An IsoFLOP fit (``isoflop.json``: parabolas, frontier, loss surface, validation), or None."""
        return self.read_json("isoflop.json")

    def mixture_report(self) -> dict[str, Any] | None:
        return self.read_json("mixture_report.json")

    def manifest(self) -> dict[str, Any] | None:
        """A token store's ``manifest.json`` (documents, tokens and skipped documents per source), or None."""
        return self.read_json("manifest.json")

    def corpus_filter(self) -> dict[str, Any] | None:
        """A dedup or decontamination step's manifest (documents and bytes in and out per domain and
        source, removed per reason, clusters or matches per evaluation set, a sample), or None."""
        for name in ("dedup_manifest.json", "decontamination_manifest.json"):
            man = self.read_json(name)
            if man:
                return man
        return None

    def train_summary(self) -> dict[str, Any] | None:
        return self.read_json("train_summary.json")

    @property
    def horizon(self) -> int | None:
        """A training step's total steps, from its config (never from how far it got)."""
        return train_horizon(self.config)


def _size(path: str) -> int:
    if not os.path.isdir(path):
        try:
            return os.path.getsize(path)
        except OSError:
            return 0
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


# --------------------------------------------------------------------------------------------- #
# experiments                                                                                      #
# --------------------------------------------------------------------------------------------- #


@dataclasses.dataclass
class Experiment:
    """An experiment's steps (dependencies before dependents) and its run records."""

    name: str
    prefix: str
    steps: list[Step]
    description: str | None = None
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Experiment records (under ``PREFIX/experiments``, each with its runs merged) this experiment was built
    from, newest last."""
    source: str | None = None
    """The experiment file, when loaded from one."""
    card: dict[str, str] | None = None
    """The experiment card (hypothesis, goal, risks, contingency) given to ``executor_main``."""

    def __iter__(self) -> Iterator[Step]:
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    def step(self, name: str) -> Step:
        """A step by name (``quickstart/train-tiny-moe``), by ``name-hash`` or by output path."""
        for s in self.steps:
            if name in (s.name, f"{s.name}-{s.hash}", s.output_path):
                return s
        raise KeyError(f"no step {name!r} in experiment {self.name!r}; steps: "
                       + ", ".join(s.name for s in self.steps[:20]) + (" ..." if len(self.steps) > 20 else ""))

    def by_path(self) -> dict[str, Step]:
        return {s.output_path: s for s in self.steps}

    def dependents(self) -> dict[str, list[str]]:
        """Output path -> output paths of the steps that read it."""
        out: dict[str, list[str]] = {s.output_path: [] for s in self.steps}
        for s in self.steps:
            for d in s.dependencies:
                if d in out:
                    out[d].append(s.output_path)
        return out

    @property
    def updated(self) -> float | None:
        times = [r.get("updated") for r in self.records if r.get("updated")]
        return max(times) if times else None

    def health(self) -> dict[str, Any] | None:
        """The first health checklist among the steps, or None."""
        for s in self.steps:
            h = s.health()
            if h is not None:
                return h
        return None

    def eval_results(self) -> dict[str, dict[str, Any]]:
        """Step name -> evaluation results, for every step that wrote ``eval.json``."""
        return {s.name: r for s in self.steps if (r := s.eval_results()) is not None}


def _record_steps(records: list[dict[str, Any]]) -> list[Step]:
    seen: dict[str, Step] = {}
    for rec in records:
        for s in rec.get("steps", []):
            seen[s["output_path"]] = Step(s["output_path"], name=s.get("name"), hash=s.get("hash"),
                                          outcome=s.get("outcome"), dependencies=list(s.get("dependencies") or []),
                                          version=s.get("version"))
    return list(seen.values())


def read_records(prefix: str) -> list[tuple[str, dict[str, Any]]]:
    """``(record path, record)`` of every experiment recorded under ``prefix`` (its runs merged, see
    :func:`read_experiment_record`), oldest first."""
    out = []
    for path in experiment_record_paths(prefix):
        record = read_experiment_record(path)
        if record is not None:
            out.append((path, record))
    return sorted(out, key=lambda pr: pr[1].get("updated") or 0)


def load_prefix(prefix: str | None = None, experiment: str | None = None) -> Experiment:
    """Everything recorded under a prefix, or one experiment's record (``--experiment NAME``: the
    record file's stem, ``quickstart`` or ``quickstart-a0ea2d014f``). Steps found under the prefix
    without any record are included when no experiment is named."""
    prefix = resolve_prefix(prefix)
    check_prefix_is_a_directory(prefix)
    records = read_records(prefix)
    if experiment:
        stem = experiment[:-3] if experiment.endswith(".py") else os.path.basename(experiment)
        chosen = [(p, r) for p, r in records
                  if os.path.basename(p)[:-5] == stem or os.path.basename(p)[:-5].rpartition("-")[0] == stem]
        if not chosen:
            names = sorted({os.path.basename(p)[:-5] for p, _ in records})
            raise FileNotFoundError(f"no experiment record {experiment!r} under {prefix}/experiments; "
                                    f"records: {', '.join(names) or 'none'}")
        chosen = chosen[-1:]  # the latest run of that experiment
        steps = _record_steps([r for _, r in chosen])
        return Experiment(os.path.basename(chosen[-1][0])[:-5], prefix, steps, chosen[-1][1].get("description"),
                          [r for _, r in chosen], card=chosen[-1][1].get("card"))
    steps = _record_steps([r for _, r in records])
    known = {s.output_path for s in steps}
    steps += [Step(p) for p in step_dirs(prefix) if p not in known]
    steps = dependency_order(steps)
    name = os.path.basename(records[-1][0])[:-5] if len(records) == 1 else os.path.basename(prefix)
    desc = records[-1][1].get("description") if len(records) == 1 else None
    card = records[-1][1].get("card") if len(records) == 1 else None
    return Experiment(name, prefix, steps, desc, [r for _, r in records], card=card)


def load_file(path: str, prefix: str | None = None) -> Experiment:
    """An experiment file's steps as planned under ``prefix`` (run or not), with its latest record."""
    prefix = resolve_prefix(prefix)
    steps, description, card = load_experiment_card(path)
    plan = plan_steps(steps, prefix)
    script = os.path.basename(path)
    record_path = experiment_record_path(plan, script)
    record = read_experiment_record(record_path)
    outcomes = {s["output_path"]: s.get("outcome") for s in (record or {}).get("steps", [])}
    out = []
    for ps in plan.steps:
        deps = [d.output_path for d in ps.dependencies + ps.nonblocking_dependencies]
        out.append(Step(ps.output_path, name=ps.name, hash=ps.hash, outcome=outcomes.get(ps.output_path),
                        dependencies=deps, version={**ps.version(), "config": mask_leaves(ps.config_leaves)},
                        planned_config=to_jsonable(resolve_config(ps, plan))))
    name = os.path.basename(record_path)[:-5]
    return Experiment(name, prefix, out, description, [record] if record else [], source=os.path.abspath(path),
                      card=card)


def load(source: str | None = None, *, prefix: str | None = None, experiment: str | None = None) -> Experiment:
    """An experiment from a file (``load("experiments/quickstart.py", prefix=...)``) or from what a prefix
    holds (``load(prefix="local_store")``, optionally one ``experiment`` record by name)."""
    if source is not None and source.endswith(".py"):
        return load_file(source, prefix)
    return load_prefix(source or prefix, experiment)


def dependency_order(steps: list[Step]) -> list[Step]:
    """Dependencies before dependents (stable otherwise); steps whose inputs are unknown keep their place."""
    by_path = {s.output_path: s for s in steps}
    done: set[str] = set()
    out: list[Step] = []
    for root in steps:
        stack = [(root, iter(root.dependencies))]
        if root.output_path in done:
            continue
        on_stack = {root.output_path}
        while stack:
            s, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                if s.output_path not in done:
                    done.add(s.output_path)
                    out.append(s)
                continue
            d = by_path.get(nxt)
            if d is not None and d.output_path not in done and d.output_path not in on_stack:
                on_stack.add(d.output_path)
                stack.append((d, iter(d.dependencies)))
    return out
