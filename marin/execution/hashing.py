"""Canonical encoding of versioned config values, and the step hash built from it.

The hash of a step is what names its output directory, so the encoding must be identical in every
process, on every machine and under every prefix. We therefore define it explicitly instead of
relying on ``repr`` or ``pickle``:

========================  =======================================================================
Python value              canonical JSON
========================  =======================================================================
``None``, ``bool``        ``null``, ``true`` / ``false``
``int``                   a JSON integer (exact, arbitrary size)
``float``                 ``{"float": repr(x)}`` (shortest round-trip repr; NaN and inf refused)
``str``                   a JSON string
``enum.Enum`` member      ``{"enum": "<Class qualname>.<member name>"}``
``pathlib.PurePath``      ``{"path": "<posix form>"}``
``tuple``                 ``{"tuple": [...]}``
``list``                  ``[...]``
``dict`` (str keys)       ``{"dict": {key: value, ...}}`` (keys sorted)
dataclass instance        ``{"dataclass": "<qualname>", "fields": {name: value, ...}}``
========================  =======================================================================

Tags keep ``1``, ``1.0``, ``True`` and ``"1"`` apart, and a tuple apart from a list. The JSON text is
produced with sorted keys and no whitespace, then hashed with SHA-256. Anything else (sets, arrays,
callables, dicts with non-str keys, ...) is refused with an :class:`UnhashableConfigError` that
names the field path, because silently hashing ``repr`` would give different hashes across runs.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
import pathlib
from typing import Any

HASH_CHARS = 10
"""Number of hex characters of the SHA-256 used in output directory names."""


class UnhashableConfigError(TypeError):
    """A versioned config value has no canonical encoding (wrong type, NaN, non-str dict key)."""


def encode(value: Any, path: str = "") -> Any:
    """Return the canonical JSON-able form of ``value``; ``path`` names it in error messages."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, enum.Enum):
        return {"enum": f"{type(value).__qualname__}.{value.name}"}
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            raise UnhashableConfigError(
                f"config field {path or '<root>'!s} is {value!r}: NaN and infinity cannot be versioned "
                "(they have no stable meaning as a version); use a finite number or None"
            )
        return {"float": repr(value)}
    if isinstance(value, pathlib.PurePath):
        return {"path": value.as_posix()}
    if isinstance(value, tuple):
        return {"tuple": [encode(v, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise UnhashableConfigError(
                    f"config field {path or '<root>'} has a dict key {k!r} of type {type(k).__name__}; "
                    "versioned dicts must have str keys"
                )
            out[k] = encode(v, join_key(path, k))
        return {"dict": out}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {
            f.name: encode(getattr(value, f.name), join_attr(path, f.name)) for f in dataclasses.fields(value)
        }
        return {"dataclass": type(value).__qualname__, "fields": fields}
    raise UnhashableConfigError(
        f"config field {path or '<root>'} has type {type(value).__module__}.{type(value).__qualname__}, "
        "which has no canonical encoding; versioned values may be str, int, float, bool, None, enums, "
        "pathlib paths, tuples, lists, dicts with str keys or dataclasses of those"
    )


def join_attr(path: str, name: str) -> str:
    """Field path of attribute ``name`` under ``path`` (``model.d_model``)."""
    return f"{path}.{name}" if path else name


def join_key(path: str, key: str) -> str:
    """Field path of dict key ``key`` under ``path`` (``weights["web code"]``); unambiguous for any key.

    Keys of a top-level dict config read like attributes (``opt``) when they are identifiers."""
    if not path and key.isidentifier():
        return key
    return f"{path}[{json.dumps(key)}]"


def canonical_json(value: Any) -> str:
    """Serialize an already-encoded value deterministically (sorted keys, no spaces, ASCII)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def version_digest(name: str, config_leaves: dict[str, Any], dependency_digests: dict[str, str]) -> str:
    """Full SHA-256 hex digest of a step version.

    ``config_leaves`` maps field path -> encoded versioned value (input placeholders are encoded as
    ``{"input": <upstream digest>, "subpath": ...}``); ``dependency_digests`` maps each upstream
    step's name to its own full digest. Including upstream digests (a Merkle tree) commits to the
    upstream's full version without re-encoding it, so hashing a 1,000-step chain stays linear.
    """
    body = {
        "name": name,
        "config": config_leaves,
        "dependencies": sorted(dependency_digests.values()),
    }
    return sha256_hex(canonical_json(body))
