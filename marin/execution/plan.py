"""Planning: from declared steps to a DAG of versioned, path-named steps. Pure: no I/O.

``plan_steps`` walks every config (under the versioning rule of :mod:`marin.execution.versioning`:
every value is versioned but a field declared live), collects dependencies (including steps reached only through
dependencies), refuses cycles and non-step inputs, computes each step's version digest bottom-up,
collapses identical declarations, and assigns output paths.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import posixpath
import re
import types
from typing import Any, Iterator

from marin.execution.hashing import HASH_CHARS, UnhashableConfigError, encode, key_text, version_digest
from marin.execution.jsonable import to_jsonable
from marin.execution.step import ExecutorStep, InputName, InvalidStepError, OutputName, VersionedValue
from marin.execution.versioning import versioned_view
from marin.execution.walker import DESCEND, ConfigStructureError, FieldPath, container_kind, walk


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
    spelled: dict[str, str] = dataclasses.field(default_factory=dict)
    """Leaf name -> the field path as the config spells it, where they differ (a group's fields:
    ``peak_lr`` is spelled ``optimizer.peak_lr``), so review tools can mark a recorded field versioned."""

    @property
    def name(self) -> str:
        return self.step.name

    @property
    def hash(self) -> str:
        return self.digest[:HASH_CHARS]

    def version(self) -> dict[str, Any]:
        """The version tree one level deep: this step's leaves plus each upstream's name and hash."""
        deps = self.dependencies + self.nonblocking_dependencies
        out = {
            "name": self.name,
            "hash": self.hash,
            "config": self.config_leaves,
            "dependencies": {d.output_path: {"name": d.name, "hash": d.hash} for d in deps},
        }
        if self.spelled:  # only grouped configs have it, so every other record is as it was
            out["spelled"] = dict(self.spelled)
        return out

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


_PLACEHOLDERS = (VersionedValue, InputName, OutputName, ExecutorStep)


def _is_plain_object(value: Any) -> bool:
    """An instance of a user class that the executor cannot rebuild (not a dataclass or container)."""
    return (
        hasattr(value, "__dict__")
        and not isinstance(value, (type, types.ModuleType, types.FunctionType, types.MethodType,
                                   types.BuiltinFunctionType, functools.partial))
        and container_kind(value) is None
    )


def walk_placeholders(value: Any, path: FieldPath | str = "") -> list[tuple[FieldPath, Any]]:
    """``(field path, placeholder)`` for every placeholder in a config, depth first.

    Placeholders are ``VersionedValue``, ``InputName``, ``OutputName`` and (an error the caller
    reports) a bare ``ExecutorStep``. Containers are those of :mod:`marin.execution.walker`. A
    placeholder inside anything else (a plain object, a dict key) could never be replaced, so it is
    refused here with a :class:`PlanError`, before anything runs.
    """
    found: list[tuple[FieldPath, Any]] = []

    def visit(v: Any, p: FieldPath) -> Any:
        if isinstance(v, _PLACEHOLDERS):
            found.append((p, v))
            return None
        if isinstance(v, dict):
            for k in v:
                if isinstance(k, _PLACEHOLDERS):
                    raise PlanError(f"config field {p.describe()} has a placeholder ({type(k).__name__}) as a dict "
                                    "key; placeholders may only be values")
        if container_kind(v) is not None:
            return DESCEND
        if _is_plain_object(v):
            _refuse_placeholders_in_object(v, p)
        return None

    walk(value, visit, lambda *_: None, path, key_text)
    return found


def _refuse_placeholders_in_object(obj: Any, path: FieldPath) -> None:
    """Raise PlanError if a plain object's attributes hold a placeholder (the executor cannot replace it)."""
    try:
        inner = walk_placeholders(dict(vars(obj)), path)
    except ConfigStructureError:
        return  # a deep or cyclic object graph (a client, a model): not a config, nothing to resolve
    if inner:
        where, ph = inner[0]
        cls = type(obj).__qualname__
        raise PlanError(
            f"config field {path.describe()} is a {cls} object, which is not a dataclass, dict, list or tuple, "
            f"and its attribute {where.describe()} holds a {type(ph).__name__} placeholder that the executor "
            f"cannot replace there; make {cls} a @dataclasses.dataclass (or pass a dict)"
        )


def located(e: Exception, step: ExecutorStep) -> Exception:
    """``e`` (a refusal of ``step``, one line) with the experiment file's line that declared the step
    appended, where it is known (:attr:`ExecutorStep.declared_at`): the plan refuses after the file
    was read, and the user's line is where to fix it."""
    where = getattr(step, "declared_at", None)
    return type(e)(f"{e} (at {where})") if where and "\n" not in str(e) else e


def _inputs_of(step: ExecutorStep) -> list[tuple[str, Any]]:
    """:func:`_inputs_of_declared`, its refusals with the step's line (:func:`located`)."""
    try:
        return _inputs_of_declared(step)
    except (PlanError, InvalidStepError, UnhashableConfigError) as e:
        raise located(e, step) from None


def _inputs_of_declared(step: ExecutorStep) -> list[tuple[str, Any]]:
    """The placeholders of ``step``'s config as the versioning rule sees it (:func:`versioned_view`):
    every value wrapped as versioned but a live field's. The config as declared is walked first, so a
    cycle, a bare step or a placeholder the executor could not replace is refused before the rule reads it."""
    try:
        declared = walk_placeholders(step.config)
    except UnhashableConfigError as e:
        raise type(e)(f"step {step.name!r}: {e}") from None
    except PlanError as e:
        raise PlanError(f"step {step.name!r}: {e}") from None
    _refuse_credentials_in_config(step)
    for path, ph in declared:
        where = f"step {step.name!r}, config field {path.describe()}"
        if isinstance(ph, ExecutorStep):
            raise PlanError(f"{where} holds the step {ph.name!r} itself; use output_path_of(step) to depend on it")
        if isinstance(ph, InputName) and not isinstance(ph.step, ExecutorStep):
            raise PlanError(
                f"{where} is an input on {type(ph.step).__name__} ({ph.step!r:.80}), which is not an "
                "ExecutorStep; inputs must come from output_path_of(step) of a declared step"
            )
    try:
        return walk_placeholders(versioned_view(step.config))
    except UnhashableConfigError as e:
        raise type(e)(f"step {step.name!r}: {e}") from None


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

        def push(s: ExecutorStep, stack: list = stack, path: list = path) -> None:  # this root's DFS
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


CREDENTIALS_HELP = ("an object store takes credentials from the environment, never from the URL: "
                    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or ~/.aws/credentials, AWS_PROFILE) for s3://, "
                    "GOOGLE_APPLICATION_CREDENTIALS (or `gcloud auth application-default login`) for gs://")
"""Where credentials go instead of a URL's user-info part."""


def url_credentials_masked(text: str) -> str | None:
    """``text`` with its user-info part shown as ``***`` if it is a URL that carries one
    (``s3://KEY:SECRET@bucket/x`` -> ``s3://***@bucket/x``), else None."""
    scheme, sep, rest = text.partition("://")
    authority, slash, path = rest.partition("/")
    if not sep or "@" not in authority or not scheme or "/" in scheme or " " in scheme:
        return None
    return f"{scheme}://***@{authority.rsplit('@', 1)[1]}{slash}{path}"


def refuse_url_credentials(what: str, url: str) -> None:
    """Raise PlanError if ``url`` carries credentials in its user-info part, naming ``what`` (the
    option or config field) and showing the URL masked: such a URL is printed, recorded in step
    records and reports, and quoted by the store client's errors, where no mask can find it."""
    shown = url_credentials_masked(url)
    if shown is not None:
        raise PlanError(f"{what} {shown} has credentials in it (the part before '@'); {CREDENTIALS_HELP}")


def _refuse_credentials_in_config(step: ExecutorStep) -> None:
    """Refuse a step whose config holds a URL with credentials (a data path, an input, a live
    field alike), and an override_output_path with them, before anything prints or runs."""
    def visit(v: Any, p: FieldPath) -> Any:
        if isinstance(v, VersionedValue):
            walk(v.value, visit, lambda *_: None, p, key_text)
        elif isinstance(v, str):
            refuse_url_credentials(f"step {step.name!r}: config field {p.describe()}", v)
        elif container_kind(v) is not None and not isinstance(v, _PLACEHOLDERS):  # an input is its step's
            return DESCEND
        return None

    try:
        walk(step.config, visit, lambda *_: None, "", key_text)
    except ConfigStructureError:
        pass  # a config too deep or cyclic to walk: the version's encoding refuses it, naming the step
    if step.override_output_path is not None:
        refuse_url_credentials(f"step {step.name!r}: override_output_path", step.override_output_path)


def normalize_prefix(prefix: str) -> str:
    """Absolute local path or ``scheme://...`` URL, without a trailing slash.

    A URL with a user-info part (``s3://KEY:SECRET@bucket/x``) is refused, without echoing it: the
    prefix is printed by every run, written into every step's record and passed to the store's
    client, whose errors quote it; credentials belong in the environment (:data:`CREDENTIALS_HELP`)."""
    prefix = prefix.rstrip("/") or "/"
    refuse_url_credentials("--prefix", prefix)
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
        names: dict[str, str] = {}  # version name -> field path as spelled (they differ inside a group)
        deps: dict[int, PlannedStep] = {}
        nonblocking: dict[int, PlannedStep] = {}
        for field, ph in inputs[id(step)]:
            try:
                spelled = str(field)
                path = field.version_name()  # a group's fields are named as its parent's (versioning.group)
                if names.setdefault(path, spelled) != spelled:
                    raise PlanError(f"step {step.name!r}: config fields {names[path]} and {spelled} are both named "
                                    f"{path!r} in the version (a group's fields are named as its parent's); "
                                    "rename one of them")
                if isinstance(ph, VersionedValue):
                    leaves[path] = encode(ph.value, field)
            except UnhashableConfigError as e:  # the encoding's message names the field already, as a rule
                named = str(e) if str(e).startswith("config field ") else f"config field {field.describe()}: {e}"
                raise located(UnhashableConfigError(f"step {step.name!r}: {named}"), step) from None
            except PlanError as e:
                raise located(e, step) from None
            if isinstance(ph, VersionedValue):
                pass
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
        if key in by_key:  # the same step declared twice: one node, if nothing unversioned differs
            _refuse_unversioned_difference(by_key[key], step, by_id)
            by_id[id(step)] = by_key[key]
            continue
        try:
            output_path = _output_path(prefix, step, digest[:HASH_CHARS])
        except InvalidStepError as e:
            raise located(e, step) from None
        ps = PlannedStep(
            step=step,
            digest=digest,
            output_path=output_path,
            config_leaves=leaves,
            spelled={n: p for n, p in names.items() if n != p},
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


def unversioned_view(step: ExecutorStep, by_id: dict[int, PlannedStep]) -> dict[str, str]:
    """Field path -> rendered value of every live leaf of ``step``'s config (a versioned one reads
    ``<versioned>``), placeholders by identity.

    Two declarations of one step (same name and version) must agree on this view; otherwise they
    would share one output directory although they would write different things."""
    leaves: dict[str, str] = {}

    def visit(value: Any, path: FieldPath) -> Any:
        if isinstance(value, VersionedValue):
            rendered: Any = "<versioned>"  # equal digests: equal versioned values
        elif isinstance(value, InputName):
            up = by_id.get(id(value.step))
            rendered = f"<output of {value.step.name}-{up.hash if up else '?'}>/{value.name or ''}"
        elif isinstance(value, OutputName):
            rendered = f"<this output>/{value.name or ''}"
        elif container_kind(value) is not None and not (isinstance(value, (dict, list, tuple)) and not value):
            return DESCEND
        else:
            rendered = to_jsonable(value, field_name=path.name)
        leaves[path.describe()] = re.sub(r" at 0x[0-9a-fA-F]+", "", repr(rendered))
        return None

    walk(versioned_view(step.config), visit, lambda *_: None, key_text=key_text)
    fn = step.fn
    leaves["<fn>"] = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
    return leaves


def _refuse_unversioned_difference(first: PlannedStep, again: ExecutorStep, by_id: dict[int, PlannedStep]) -> None:
    if again.config is first.step.config and again.fn is first.step.fn:
        return
    a, b = unversioned_view(first.step, by_id), unversioned_view(again, by_id)
    if a == b:
        return
    diffs = [
        f"{p}: {a.get(p, '<absent>')} vs {b.get(p, '<absent>')}"
        for p in sorted(set(a) | set(b))
        if a.get(p) != b.get(p)
    ]
    shown = "; ".join(diffs[:3]) + (f"; and {len(diffs) - 3} more" if len(diffs) > 3 else "")
    raise PlanError(
        f"step {again.name!r} is declared twice with the same version ({first.hash}) but different live "
        f"(unversioned) config ({shown}); both would use {first.output_path} and only one would run. If that "
        "field changes what the step writes, do not declare it live; else give the two steps different names"
    )


def resolve_config(ps: PlannedStep, plan: Plan) -> Any:
    """``ps``'s config with placeholders replaced by concrete paths and versioned values unwrapped."""

    def sub(base: str, name: str | None) -> str:
        return base if not name else f"{base}/{name.lstrip('/')}"

    def visit(value: Any, path: FieldPath) -> Any:
        if isinstance(value, VersionedValue):
            return walk(value.value, visit, rebuild, path, key_text)
        if isinstance(value, InputName):
            return sub(plan.planned(value.step).output_path, value.name)
        if isinstance(value, OutputName):
            return sub(ps.output_path, value.name)
        return DESCEND if container_kind(value) is not None else value

    return walk(ps.step.config, visit, rebuild, key_text=key_text)


def plain_config(config: Any) -> Any:
    """``config`` with every versioned value unwrapped and its placeholders kept: a declared step's
    config as its builder made it, before :func:`marin.execution.versioning.versioned_config` marked
    it (what a builder reads back of another step, e.g. a ladder fit of its rungs' models)."""

    def visit(value: Any, path: FieldPath) -> Any:
        if isinstance(value, VersionedValue):
            return walk(value.value, visit, rebuild, path, key_text)
        if isinstance(value, (InputName, OutputName)):
            return value
        return DESCEND if container_kind(value) is not None else value

    return walk(config, visit, rebuild, key_text=key_text)


def rebuild(value: Any, kind: str, items: list[tuple[str, Any, Any]], path: FieldPath) -> Any:
    """``value`` with its children replaced by ``items`` (``value`` itself when nothing changed)."""
    if kind == "dataclass":
        init = {f.name for f in dataclasses.fields(value) if f.init}
        changes = {k: v for _, k, v in items if k in init and v is not getattr(value, k)}
        return dataclasses.replace(value, **changes) if changes else value
    if kind == "dict":
        if all(v is value[k] for _, k, v in items):
            return value
        out = {k: v for _, k, v in items}
        return out if type(value) is dict else type(value)(out)
    new = [v for _, _, v in items]
    if kind == "set":
        return value if all(a is b for a, b in zip(new, (k for _, k, _ in items))) else type(value)(new)
    if all(a is b for a, b in zip(new, value)):
        return value
    return type(value)(new) if not hasattr(value, "_fields") else type(value)(*new)
