"""An experiment as the notebook API reads it: :class:`Experiment` (its steps, dependencies
before dependents, and its run records), loaded from an experiment file or from what a prefix holds."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import Any

from marin.execution.experiment_record import experiment_record_path, experiment_record_paths, read_experiment_record
from marin.execution.jsonable import mask_leaves, to_jsonable
from marin.execution.plan import plan_steps, resolve_config
from marin.execution.prefix import resolve_prefix
from marin.review.experiment_file import load_experiment_card
from marin.review.stepdir import Step
from marin.review.steps import check_prefix_is_a_directory, step_dirs


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
