"""Turn resolved configs into JSON for step info and experiment records, masking secrets.

This is for humans and review tools, not for hashing (see :mod:`marin.execution.hashing`): any value
is accepted and unknown types fall back to ``repr``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import pathlib
import re
from typing import Any

MASK = "***"
_SECRET_WORDS = {"key", "secret", "token", "password", "passwd", "apikey", "credential", "credentials"}
_WORD_SPLIT = re.compile(r"[^A-Za-z0-9]+|(?<=[a-z0-9])(?=[A-Z])")


def is_secret_field(name: str) -> bool:
    """True if a field name says it holds a secret (``api_key``, ``hfToken``, ``db_password``).

    Matching is by whole word so ``tokenizer`` or ``tokens_per_step`` are not masked.
    """
    words = {w.lower() for w in _WORD_SPLIT.split(name) if w}
    return bool(words & _SECRET_WORDS)


def to_jsonable(value: Any, *, field_name: str = "") -> Any:
    """A JSON-compatible rendering of ``value`` with secret-named fields replaced by ``***``."""
    if field_name and is_secret_field(field_name) and value is not None:
        return MASK
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, pathlib.PurePath):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_jsonable(v, field_name=str(k)) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name), field_name=f.name) for f in dataclasses.fields(value)}
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    return repr(value)


def mask_leaves(leaves: dict[str, Any]) -> dict[str, Any]:
    """Mask encoded versioned leaves whose last path component names a secret."""
    out = {}
    for path, value in leaves.items():
        last = re.split(r"[.\[\]\"]+", path.strip('"]'))[-1] if path else ""
        out[path] = MASK if last and is_secret_field(last) else value
    return out
