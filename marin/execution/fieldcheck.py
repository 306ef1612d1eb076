"""The checks every config dataclass runs on its numeric fields, in one place: a count is a whole
number, a float is a finite number (NaN and infinity have no meaning as a learning rate, a horizon or
a threshold, and cannot be versioned), a bool is True or False, each within the field's range; the
refusal is one line naming the field as the user spells it (``optimizer.peak_lr``).

A config's ``__post_init__`` calls :func:`check_fields` with its ranges; the field's type comes from
its annotation (``int``, ``float``, ``bool``, each optionally ``| None``), so a field added tomorrow is
checked for its type without a line here. Run where the config is built, a bad value is refused
while the experiment file is read, with that file's line (:func:`marin.execution.errors.file_mistake_line`):
before any plan, dry run or pool. A placeholder (``versioned(...)``, an input or output path) is
judged by the value it wraps, or not at all.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Mapping
from typing import Any

from marin.execution.step import InputName, OutputName, VersionedValue

RANGES: dict[str, tuple[float, bool, float, bool]] = {
    "> 0": (0, False, math.inf, False),
    ">= 0": (0, True, math.inf, False),
    ">= 1": (1, True, math.inf, False),
    "[0, 1]": (0, True, 1, True),
    "[0, 1)": (0, True, 1, False),
    "(0, 1]": (0, False, 1, True),
    "(0, 1)": (0, False, 1, False),
}
"""The ranges a field may declare: (low, low included, high, high included)."""

_KINDS = {"int": int, "float": float, "bool": bool}


class FieldError(ValueError):
    """A config field whose value no run can use; the message is one line naming the field."""


@functools.cache
def numeric_fields(cls: type) -> dict[str, tuple[type, bool]]:
    """``name -> (int | float | bool, None allowed)`` for each field of dataclass ``cls`` annotated
    ``int``, ``float`` or ``bool`` (optionally ``| None``); read from the annotation's text, so no
    annotation is evaluated."""
    out = {}
    for f in dataclasses.fields(cls):
        text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", repr(f.type))
        parts = [p.strip() for p in text.replace("typing.", "").removeprefix("Optional[").rstrip("]").split("|")]
        optional = "None" in parts or text.replace("typing.", "").startswith("Optional[")
        kinds = [p for p in parts if p != "None"]
        if len(kinds) == 1 and kinds[0] in _KINDS:
            out[f.name] = (_KINDS[kinds[0]], optional)
    return out


def _describe(kind: type, rule: str | None, optional: bool) -> str:
    what = {int: "a whole number", float: "a finite number", bool: "True or False"}[kind] + (
        " or None" if optional else "")
    if rule is None:
        return what
    return (f"in {rule}" if rule.startswith(("[", "(")) else rule) + f" ({what})"


def check_number(name: str, value: Any, kind: type = float, rule: str | None = None, optional: bool = False) -> None:
    """Refuse ``value`` for the field ``name`` (as the user spells it) unless it is of ``kind``
    (``int``: a whole number, not a bool; ``float``: any finite real number; ``bool``), within
    ``rule`` (a key of :data:`RANGES`), or None where ``optional``."""
    if isinstance(value, VersionedValue):
        value = value.value
    if isinstance(value, (InputName, OutputName)) or (value is None and optional):
        return
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    else:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok and rule is not None:
        low, low_in, high, high_in = RANGES[rule]
        ok = (value >= low if low_in else value > low) and (value <= high if high_in else value < high)
    if not ok:
        number = isinstance(value, (numbers.Number, type(None)))
        shown = repr(value) if number else f"{value!r} ({type(value).__name__})"
        raise FieldError(f"{name} must be {_describe(kind, rule, optional)}, got {shown}")


def check_fields(config: Any, where: str = "", rules: Mapping[str, str] | None = None) -> None:
    """Check every numeric field of the dataclass ``config`` (:func:`numeric_fields`) for its type and,
    where ``rules`` names one, its range; ``where`` prefixes the field's name in the message
    (``"optimizer."``). A rule for a field that is not numeric is a programming error."""
    fields = numeric_fields(type(config))
    unknown = set(rules or {}) - set(fields)
    if unknown:
        raise AssertionError(f"{type(config).__name__}: ranges for fields that are not numeric: {sorted(unknown)}")
    for name, (kind, optional) in fields.items():
        check_number(f"{where}{name}", getattr(config, name), kind, (rules or {}).get(name), optional)
