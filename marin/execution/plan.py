"""Planning: from declared steps to a DAG of versioned, path-named steps. Pure: no I/O.

``plan_steps`` walks every config, collects dependencies (including steps reached only through
dependencies), refuses cycles and non-step inputs, computes each step's version digest bottom-up,
collapses identical declarations, and assigns output paths.
"""

from __future__ import annotations

import dataclasses
import posixpath
from typing import Any, Iterator

from marin.execution.hashing import (
    HASH_CHARS,
    UnhashableConfigError,
    encode,
    join_attr,
    join_key,
    version_digest,
)
from marin.execution.step import ExecutorStep, InputName, InvalidStepError, OutputName, VersionedValue


class PlanError(ValueError):
    """The declared steps cannot form a valid DAG (cycle, non-step input, path outside prefix)."""


@dataclasses.dataclass(eq=False)
class PlannedStep:
    """A step with its identity fixed: version digest, short hash, output path, dependencies."""

    step: ExecutorStep
    digest: str
    output_path: str
    config_leaves: dict[str, Any]
    dependencies: list["PlannedStep"]
    """Upstream steps this step waits for (blocking inputs)."""
    nonblocking_dependencies: list["PlannedStep"]
    """Upstream steps that are part of the hash but not waited for."""

    @property
    def name(self) -> str:
        return self.step.name

    @property
    def hash(self) -> str:
        return self.digest[:HASH_CHARS]

    def version(self) -> dict[str, Any]:
        """The version tree one level deep: this step's leaves plus each upstream's name and hash."""
        deps = self.dependencies + self.nonblocking_dependencies
        return {
            "name": self.name,
            "hash": self.hash,
            "config": self.config_leaves,
            "dependencies": {d.output_path: {"name": d.name, "hash": d.hash} for d in deps},
        }

    def __repr__(self) -> str:
        return f"PlannedStep({self.name}-{self.hash})"


@dataclasses.dataclass
class Plan:
    prefix: str
    steps: list[PlannedStep]
    """Every step, dependencies before dependents."""
    _by_id: dict[int, PlannedStep]

    def planned(self, step: ExecutorStep) -> PlannedStep:
        return self._by_id[id(step)]

    def dependents(self) -> dict[PlannedStep, list[PlannedStep]]:
        out: dict[PlannedStep, list[PlannedStep]] = {s: [] for s in self.steps}
        for s in self.steps:
            for d in s.dependencies + s.nonblocking_dependencies:
                out[d].append(s)
        return out


def walk_placeholders(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Yield ``(field path, placeholder)`` for every placeholder in a config, depth first.

    Placeholders are ``VersionedValue``, ``InputName``, ``OutputName`` and (an error the caller
    reports) a bare ``ExecutorStep``. Containers walked: dataclasses, dicts, lists, tuples.
    """
    if isinstance(value, (VersionedValue, InputName, OutputName, ExecutorStep)):
        yield path, value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from walk_placeholders(getattr(value, f.name), join_attr(path, f.name))
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from walk_placeholders(v, join_key(path, k) if isinstance(k, str) else f"{path}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from walk_placeholders(v, f"{path}[{i}]")


def _inputs_of(step: ExecutorStep) -> list[tuple[str, Any]]:
    found = list(walk_placeholders(step.config))
    for path, ph in found:
        where = f"step {step.name!r}, config field {path or '<root>'}"
        if isinstance(ph, ExecutorStep):
            raise PlanError(f"{where} holds the step {ph.name!r} itself; use output_path_of(step) to depend on it")
        if isinstance(ph, InputName) and not isinstance(ph.step, ExecutorStep):
            raise PlanError(
                f"{where} is an input on {type(ph.step).__name__} ({ph.step!r:.80}), which is not an "
                "ExecutorStep; inputs must come from output_path_of(step) of a declared step"
            )
    return found


def _topological(roots: list[ExecutorStep]) -> tuple[list[ExecutorStep], dict[int, list[tuple[str, Any]]]]:
    """Post-order of all steps reachable from ``roots``; raises PlanError naming any cycle."""
    inputs: dict[int, list[tuple[str, Any]]] = {}
    order: list[ExecutorStep] = []
    state: dict[int, int] = {}  # 1 = on the DFS stack, 2 = done
    for root in roots:
        if not isinstance(root, ExecutorStep):
            raise PlanError(f"executor_main(steps=...) got {type(root).__name__} ({root!r:.80}), not an ExecutorStep")
        if state.get(id(root)) == 2:
            continue
        stack: list[tuple[ExecutorStep, Iterator[ExecutorStep]]] = []
        path: list[ExecutorStep] = []

        def push(s: ExecutorStep) -> None:
            if id(s) not in inputs:
                inputs[id(s)] = _inputs_of(s)
            state[id(s)] = 1
            path.append(s)
            deps = (ph.step for _, ph in inputs[id(s)] if isinstance(ph, InputName))
            stack.append((s, iter(deps)))

        push(root)
        while stack:
            s, deps = stack[-1]
            nxt = next(deps, None)
            if nxt is None:
                stack.pop()
                path.pop()
                state[id(s)] = 2
                order.append(s)
            elif state.get(id(nxt)) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise PlanError("dependency cycle: " + " -> ".join(c.name for c in cycle))
            elif state.get(id(nxt)) != 2:
                push(nxt)
    return order, inputs


def _output_path(prefix: str, step: ExecutorStep, short_hash: str) -> str:
    if step.override_output_path is None:
        return f"{prefix}/{step.name}-{short_hash}"
    override = step.override_output_path.rstrip("/")
    if not (override.startswith("/") or "://" in override):
        override = f"{prefix}/{override}"
    scheme, sep, rest = override.partition("://")
    norm = f"{scheme}{sep}{posixpath.normpath(rest)}" if sep else posixpath.normpath(override)
    if not norm.startswith(prefix + "/"):
        raise InvalidStepError(
            f"step {step.name!r}: override_output_path {step.override_output_path!r} resolves to {norm!r}, "
            f"outside the prefix {prefix!r}; outputs must live under the prefix"
        )
    return norm


def normalize_prefix(prefix: str) -> str:
    """Absolute local path or ``scheme://...`` URL, without a trailing slash."""
    import os

    prefix = prefix.rstrip("/") or "/"
    if "://" in prefix:
        if prefix.startswith("file://"):
            return os.path.abspath(prefix[len("file://"):])
        return prefix
    return os.path.abspath(os.path.expanduser(prefix))


def plan_steps(steps: list[ExecutorStep], prefix: str) -> Plan:
    """Plan ``steps`` and everything they depend on under ``prefix``."""
    prefix = normalize_prefix(prefix)
    order, inputs = _topological(list(steps))
    by_id: dict[int, PlannedStep] = {}
    by_key: dict[tuple[str, str], PlannedStep] = {}
    by_path: dict[str, PlannedStep] = {}
    planned: list[PlannedStep] = []
    for step in order:
        leaves: dict[str, Any] = {}
        deps: dict[int, PlannedStep] = {}
        nonblocking: dict[int, PlannedStep] = {}
        for path, ph in inputs[id(step)]:
            if isinstance(ph, VersionedValue):
                try:
                    leaves[path] = encode(ph.value, path)
                except UnhashableConfigError as e:
                    raise UnhashableConfigError(f"step {step.name!r}: {e}") from None
            elif isinstance(ph, InputName):
                up = by_id[id(ph.step)]
                leaves[path] = {"input": up.digest, "subpath": ph.name}
                (deps if ph.block_on_step else nonblocking)[id(up)] = up
            elif isinstance(ph, OutputName):
                leaves[path] = {"output": ph.name}
        for k in list(nonblocking):
            if k in deps:
                del nonblocking[k]
        dep_digests = {f"{d.name}-{d.digest}": d.digest for d in [*deps.values(), *nonblocking.values()]}
        digest = version_digest(step.name, leaves, dep_digests)
        key = (step.name, digest)
        if key in by_key:  # the same step declared twice: one node
            by_id[id(step)] = by_key[key]
            continue
        ps = PlannedStep(
            step=step,
            digest=digest,
            output_path=_output_path(prefix, step, digest[:HASH_CHARS]),
            config_leaves=leaves,
            dependencies=list(deps.values()),
            nonblocking_dependencies=list(nonblocking.values()),
        )
        if ps.output_path in by_path:
            raise PlanError(
                f"steps {by_path[ps.output_path].name!r} and {step.name!r} have different versions but the "
                f"same output path {ps.output_path!r} (check override_output_path)"
            )
        by_key[key] = by_id[id(step)] = by_path[ps.output_path] = ps
        planned.append(ps)
    return Plan(prefix=prefix, steps=planned, _by_id=by_id)


def resolve_config(ps: PlannedStep, plan: Plan) -> Any:
    """``ps``'s config with placeholders replaced by concrete paths and versioned values unwrapped."""

    def sub(base: str, name: str | None) -> str:
        return base if not name else f"{base}/{name.lstrip('/')}"

    def go(value: Any) -> Any:
        if isinstance(value, VersionedValue):
            return go(value.value)
        if isinstance(value, InputName):
            return sub(plan.planned(value.step).output_path, value.name)
        if isinstance(value, OutputName):
            return sub(ps.output_path, value.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            changes = {}
            for f in dataclasses.fields(value):
                if not f.init:
                    continue
                old = getattr(value, f.name)
                new = go(old)
                if new is not old:
                    changes[f.name] = new
            return dataclasses.replace(value, **changes) if changes else value
        if isinstance(value, dict):
            items = {k: go(v) for k, v in value.items()}
            return items if any(items[k] is not value[k] for k in value) else value
        if isinstance(value, (list, tuple)):
            items = [go(v) for v in value]
            if all(a is b for a, b in zip(items, value)):
                return value
            return type(value)(items) if not hasattr(value, "_fields") else type(value)(*items)
        return value

    return go(ps.step.config)
