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
``dict`` (other keys)     ``{"dict_items": [[key, value], ...]}`` (sorted by the key's encoding)
``set``, ``frozenset``    ``{"set": [...]}`` (sorted by each member's encoding)
dataclass instance        ``{"dataclass": "<qualname>", "fields": {name: value, ...}}`` (a field
                          declared ``added_later`` is left out while it holds the value of the steps
                          recorded before it, so a dataclass versioned as one value keeps the
                          encoding it had before the field)
========================  =======================================================================

Tags keep ``1``, ``1.0``, ``True`` and ``"1"`` apart, and a tuple apart from a list. Sets and dict
keys are ordered by their canonical encoding, never by Python's hash order (which changes with
``PYTHONHASHSEED``). The JSON text is produced with sorted keys and no whitespace, then hashed with
SHA-256. Anything else (arrays, callables, arbitrary objects, ...) is refused with an
:class:`UnhashableConfigError` that names the field path, because silently hashing ``repr`` would
give different hashes across runs. The traversal is :mod:`marin.execution.walker`'s.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
import pathlib
from typing import Any

from marin.execution.walker import (  # noqa: F401  (join_*, the errors and the rule's key are re-exported)
    DESCEND,
    KEY,
    VERSIONING_RULE,
    ConfigStructureError,
    FieldPath,
    UnhashableConfigError,
    container_kind,
    join_attr,
    join_key,
    walk,
)

HASH_CHARS = 10
"""Number of hex characters of the SHA-256 used in output directory names."""


def is_added_later(f: dataclasses.Field) -> bool:
    """Whether ``f`` was declared with :func:`marin.execution.versioning.added_later`."""
    return (f.metadata.get(VERSIONING_RULE) or ("",))[0] == "added_later"


BEFORE_KEY = "marin.value_before"
"""The field-metadata key of an ``added_later`` field's value in the steps recorded before it existed,
when that differs from the default a new config gets."""


def field_default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def value_before(f: dataclasses.Field) -> Any:
    """What an ``added_later`` field held in every step recorded before it existed: the value a record
    that lacks the field reads back as, and the value left out of the hash. It is the field's default
    unless the field was declared with another (``added_later(default=new, before=old)``): a new config
    gets the current behaviour, an old record keeps its own."""
    return f.metadata[BEFORE_KEY] if BEFORE_KEY in f.metadata else field_default(f)


def encode(value: Any, path: FieldPath | str = "") -> Any:
    """Return the canonical JSON-able form of ``value``; ``path`` names it in error messages."""
    return walk(value, _encode_leaf, _encode_container, path, key_text)


_TAGS = {"float", "enum", "path", "tuple", "dict", "dict_items", "set"}


def plain(encoded: Any) -> Any:
    """An encoded value (:func:`encode`) as a person reads it, for review tools: ``{"float": "3.0"}``
    reads ``3.0``, a tuple or set a list, a dict a dict, a dataclass its fields, an enum and a path
    their text. The encoding's tags keep ``1`` and ``1.0`` apart for hashing; a comparison table
    compares the encodings and shows these."""
    if isinstance(encoded, list):
        return [plain(v) for v in encoded]
    if not isinstance(encoded, dict):
        return encoded
    if len(encoded) == 1 and next(iter(encoded)) in _TAGS:
        tag, value = next(iter(encoded.items()))
        if tag == "float":
            return float(value)
        if tag in ("enum", "path"):
            return value
        if tag in ("tuple", "set"):
            return [plain(v) for v in value]
        if tag == "dict":
            return {k: plain(v) for k, v in value.items()}
        keys = [plain(k) for k, _ in value]  # dict_items: keys that are not str read as JSON text
        return {k if isinstance(k, str) else json.dumps(k): plain(v) for k, (_, v) in zip(keys, value)}
    if set(encoded) == {"dataclass", "fields"}:
        return {k: plain(v) for k, v in encoded["fields"].items()}
    return {k: plain(v) for k, v in encoded.items()}  # an input placeholder: {"input": digest, "subpath": ...}


def key_text(key: Any) -> str:
    """Canonical text of a dict key: JSON of a str, else the canonical encoding of the key.

    This is how a field path names a non-str key (``weights[{"set":["a","b"]}]``), so the path is the
    same in every process. Raises UnhashableConfigError for keys without one (objects whose only
    text is ``repr``)."""
    if isinstance(key, str):
        return json.dumps(key)
    try:
        return canonical_json(encode(key))
    except UnhashableConfigError as e:
        raise UnhashableConfigError(
            f"dict key {key!r:.80} of type {type(key).__name__} has no canonical encoding ({e}); a versioned "
            "value under it would be named differently in each process: use str, int, tuple or frozenset keys"
        ) from None


def _encode_leaf(value: Any, path: FieldPath) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, enum.Enum):
        return {"enum": f"{type(value).__qualname__}.{value.name}"}
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            raise UnhashableConfigError(
                f"config field {path.describe()} is {value!r}: NaN and infinity cannot be versioned "
                "(they have no stable meaning as a version); use a finite number or None"
            )
        return {"float": repr(value)}
    if isinstance(value, pathlib.PurePath):
        return {"path": value.as_posix()}
    if container_kind(value) is not None:
        return DESCEND
    raise UnhashableConfigError(
        f"config field {path.describe()} has type {type(value).__module__}.{type(value).__qualname__}, "
        "which has no canonical encoding; versioned values may be str, int, float, bool, None, enums, "
        "pathlib paths, tuples, lists, sets, dicts or dataclasses of those; a value that does not change what "
        "the step writes goes in a dataclass field declared live(\"why\")"
    )


def _encode_container(value: Any, kind: str, items: list[tuple[str, Any, Any]], path: FieldPath) -> Any:
    if kind == "list":
        return [v for _, _, v in items]
    if kind == "tuple":
        return {"tuple": [v for _, _, v in items]}
    if kind == "dataclass":
        at_default = {f.name for f in dataclasses.fields(value) if is_added_later(f)
                      and getattr(value, f.name) == value_before(f)}
        return {"dataclass": type(value).__qualname__,
                "fields": {k: v for _, k, v in items if k not in at_default}}
    if kind == "set":
        return {"set": sorted((v for _, _, v in items), key=canonical_json)}
    if all(isinstance(k, str) for _, k, _ in items):
        return {"dict": {k: v for _, k, v in items}}
    pairs = []
    for _, k, v in items:
        try:
            pairs.append([encode(k, path.child(KEY, k)), v])
        except UnhashableConfigError as e:
            raise UnhashableConfigError(
                f"config field {path.describe()} has a dict key that cannot be versioned: {e}"
            ) from None
    return {"dict_items": sorted(pairs, key=lambda kv: canonical_json(kv[0]))}


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
