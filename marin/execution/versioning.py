"""The versioning rule, declared on the config dataclasses and applied by one builder.

A step's hash must change whenever a value that changes what the step writes changes; so every
field of a config dataclass is **versioned** unless the class says otherwise, field by field, in the
field's metadata:

* :func:`live` ``(reason)``: the field may change on a live run without changing what the step
  writes (checkpoint cadence, telemetry, the device pool, how work is spread), so it is left out of
  the version and a changed value keeps the step's output path. The reason is required: it is what
  the docs' "what is versioned" table prints.
* :func:`input_field`: the field holds a placeholder (an upstream step's output, this step's own
  output) or None. Placeholders are versioned through the upstream's hash; a plain path given
  instead is versioned as a value.
* :func:`added_later` ``(default=..., before=...)``: a field added to a config after steps were
  recorded without it. ``before`` is what those steps did (the value a record that lacks the field
  reads back as); ``default`` is what a new config gets, the current behaviour (``before`` is the
  default when not given). The field is versioned only when it differs from ``before``, so every step
  recorded before it keeps its hash, and a new config whose default differs from ``before`` gets a new
  one: a new config and an old record never share a hash while doing different things.
* :func:`by_field` ``(reason)``: a nested config (or a container of them) versioned field by field
  by its own class's rule, so that ``marin explain`` names the nested field that changed
  (``model.n_layers``); None adds nothing. Any other nested dataclass is one versioned value.
* :func:`group` ``(reason)``: a nested config that groups fields of its parent by concept
  (``TrainConfig.optimizer``): versioned field by field like ``by_field``, but its fields are
  named in the hash as the parent's own (``peak_lr``, not ``optimizer.peak_lr``), so moving the
  fields of a flat config into a group moves no hash. Records and messages spell the group
  (``optimizer.peak_lr``); two versioned fields with one name in the hash are refused at planning.

A field added to a config tomorrow is therefore in the version unless someone marks it live and
says why. The rule holds for every step's config: the planner hashes :func:`versioned_view` of it,
so a plain ``ExecutorStep`` whose dataclass config gains a field has a new hash, as a builder's step
does. :func:`versioned_config` applies the rule to one config (builders call it; applying it again,
as the planner does, changes nothing). Values the caller already wrapped (``versioned(x)``, upstream
Marin's spelling) or that hold placeholders are walked into, never wrapped again, so a config that
wraps every field by hand has the version it has without wrapping.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from marin.execution.hashing import BEFORE_KEY, VERSIONING_RULE, field_default, value_before
from marin.execution.step import InputName, OutputName, VersionedValue, versioned

RULE = VERSIONING_RULE
"""The field-metadata key; its value is ``("live", reason)``, ``("input", reason)`` or ``("by_field", reason)``."""

INPUT_REASON = "a placeholder: versioned through the upstream step's hash (this step's own output: not at all)"


def live(reason: str, **field_kwargs: Any) -> Any:
    """A ``dataclasses.field`` left out of the version, with why (``reason``) for the docs."""
    if not reason.strip():
        raise ValueError("a live (unversioned) field needs a reason")
    return dataclasses.field(metadata={RULE: ("live", reason)}, **field_kwargs)


def input_field(**field_kwargs: Any) -> Any:
    """A ``dataclasses.field`` that holds a placeholder (an input or this step's output) or None."""
    return dataclasses.field(metadata={RULE: ("input", INPUT_REASON)}, **field_kwargs)


ADDED_REASON = ("added later: versioned when it differs from what steps recorded before it did, so they keep "
                "their hashes")
_NOT_GIVEN = object()


def added_later(*, before: Any = _NOT_GIVEN, **field_kwargs: Any) -> Any:
    """A ``dataclasses.field`` that enters the version only when it differs from ``before``, the value
    of every step recorded before the field existed (a record without the field reads back as it).
    ``default`` (or ``default_factory``) is what a new config gets: the current behaviour, which may
    differ from ``before`` (then a new config has a new hash, and an old record keeps its own)."""
    if "default" not in field_kwargs and "default_factory" not in field_kwargs:
        raise ValueError("a field added later needs a default (what a new config gets)")
    metadata = {RULE: ("added_later", ADDED_REASON)}
    if before is not _NOT_GIVEN:
        metadata[BEFORE_KEY] = before
    return dataclasses.field(metadata=metadata, **field_kwargs)


def by_field(reason: str, **field_kwargs: Any) -> Any:
    """A ``dataclasses.field`` holding a nested config versioned field by field (see the module doc)."""
    return dataclasses.field(metadata={RULE: ("by_field", reason)}, **field_kwargs)


def group(reason: str, **field_kwargs: Any) -> Any:
    """A ``dataclasses.field`` holding a group of the parent's fields (see the module doc); it needs a
    ``default_factory`` (the group's defaults)."""
    if "default_factory" not in field_kwargs:
        raise ValueError("a group field needs a default_factory (the group with its defaults)")
    return dataclasses.field(metadata={RULE: ("group", reason)}, **field_kwargs)


def rule(f: dataclasses.Field) -> tuple[str, str]:
    """``(kind, reason)`` of a field: ``versioned``, ``live``, ``input``, ``added_later`` or ``by_field``."""
    return f.metadata.get(RULE, ("versioned", ""))


def _marked(value: Any) -> bool:
    """Whether a value is, or holds, a placeholder or an already versioned part (walked into, never wrapped)."""
    if isinstance(value, (VersionedValue, InputName, OutputName)):
        return True
    if isinstance(value, dict):
        return any(_marked(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_marked(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(_marked(getattr(value, f.name)) for f in dataclasses.fields(value))
    return False


def _nested(value: Any) -> Any:
    """A value that holds marked parts: its dataclasses by their rule, its other plain parts versioned
    (a None inside adds nothing, as an absent optional config)."""
    if isinstance(value, (VersionedValue, InputName, OutputName)) or value is None:
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return versioned_config(value)
    if isinstance(value, (dict, list, tuple)):
        return _each(value, _nested)
    return versioned(value)


def _each(container: dict | list | tuple, fn: Any) -> Any:
    """``container`` (a dict, list or tuple, a named tuple too) with ``fn`` applied to each entry."""
    if isinstance(container, dict):
        return {k: fn(v) for k, v in container.items()}
    items = [fn(v) for v in container]
    return type(container)(*items) if hasattr(container, "_fields") else type(container)(items)


def versioned_config(config: Any) -> Any:
    """``config`` (a dataclass instance) with the versioning rule applied to each of its fields.

    Built without ``__init__`` (its checks need plain values); the executor rebuilds the config through
    ``__init__`` when it resolves the placeholders and unwraps the versioned values, so the step's
    function receives a normal config."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(f"versioned_config takes a config dataclass instance, got {type(config).__name__}; "
                        "wrap a plain value in versioned(...) instead")
    out = object.__new__(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        kind, _ = rule(f)
        if kind == "live" or isinstance(value, (VersionedValue, InputName, OutputName)):
            new = value
        elif kind == "added_later" and value == value_before(f):
            new = value  # as every step recorded before the field existed
        elif kind == "input":
            new = value if value is None or _marked(value) else versioned(value)
        elif kind in ("by_field", "group") or _marked(value):
            new = _nested(value)
        else:
            new = versioned(value)
        object.__setattr__(out, f.name, new)
    return out


def versioned_view(config: Any) -> Any:
    """``config`` as the executor versions it, the one rule for every step's config: every value is in
    the version except a dataclass field declared :func:`live` (and the other kinds above: an input's
    placeholder is versioned through its upstream, an ``added_later`` field only when set).

    A dataclass config gets its class's rule (:func:`versioned_config`); a dict, list or tuple config has
    every entry versioned (it has no fields to declare live: a value that stays out of the version goes
    in a dataclass field declared ``live("why")``). ``versioned(x)`` is still accepted anywhere and is
    the same version as ``x``, so configs written for the opt-in rule of upstream Marin plan the same.
    The step's function still receives the config as declared, resolved; this view is only hashed."""
    if isinstance(config, (dict, list, tuple)):
        return _each(config, _as_field)
    return _nested(config)  # a dataclass by its rule, a placeholder or None as it is, any other value versioned


def _as_field(value: Any) -> Any:
    """An entry of a dict or list config, versioned as a dataclass field is (one value, unless it holds
    placeholders or versioned parts, which are walked into)."""
    if isinstance(value, (VersionedValue, InputName, OutputName)):
        return value
    return _nested(value) if _marked(value) else versioned(value)


def versioned_leaves(cls: type, prefix: str = "", nested: dict[str, type] | None = None) -> set[str]:
    """The field paths :func:`versioned_config` makes versioned leaves of, for an instance of ``cls``
    whose fields hold plain values (placeholders in input fields): every field not live and not an
    input, with a ``by_field`` field expanded into its class's leaves. ``nested`` names the class of
    a ``by_field`` (or marked) field's value, by field name; without it a ``by_field`` field whose
    default is a config is expanded into that config's class, any other is one leaf. A ``group``
    field is expanded into its default's class, named as in the version (``peak_lr``). An
    ``added_later`` field is a leaf of the default config only when its default differs from ``before``.
    Tests derive the expected version of every config from this, so they follow the metadata."""
    out: set[str] = set()
    for f in dataclasses.fields(cls):
        kind, _ = rule(f)
        path = f"{prefix}.{f.name}" if prefix else f.name
        if kind in ("live", "input") or (kind == "added_later" and field_default(f) == value_before(f)):
            continue  # added_later: a leaf only when it differs from what earlier steps did
        if kind == "group":  # named as the parent's own fields
            out |= {f"{prefix}.{leaf}" if prefix else leaf for leaf in versioned_leaves(type(f.default_factory()))}
            continue
        sub = (nested or {}).get(f.name) or (_config_default(f) if kind == "by_field" else None)
        out |= versioned_leaves(sub, path) if sub is not None else {path}
    return out


def _config_default(f: dataclasses.Field) -> type | None:
    """The class of a field's default when the default is a config (a dataclass instance), else None."""
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        return None
    value = field_default(f)
    return type(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else None


def rule_table(cls: type) -> list[tuple[str, str, str]]:
    """``(field, "versioned" | "live" | "input" | "by field" | "group", reason)`` for each field of ``cls``, in
    declaration order: the docs' "what is versioned" table is this, for every config."""
    names = {"versioned": "versioned", "live": "live", "input": "input", "by_field": "versioned by field",
             "added_later": "versioned when set", "group": "group"}
    return [(f.name, names[rule(f)[0]], _reason(f)) for f in dataclasses.fields(cls)]


def _reason(f: dataclasses.Field) -> str:
    """A field's reason in the table; an ``added_later`` field whose earlier steps did other than its
    default says what they did."""
    kind, reason = rule(f)
    if kind == "added_later" and value_before(f) != field_default(f):
        return f"{reason}; the default is {field_default(f)!r}, steps recorded before it read {value_before(f)!r}"
    return reason
