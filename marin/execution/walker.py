"""The one traversal of step configs.

Hashing (:func:`marin.execution.hashing.encode`), rendering for humans with secrets masked
(:func:`marin.execution.jsonable.to_jsonable`), finding placeholders and resolving them
(:mod:`marin.execution.plan`) all walk a config the same way, so they all agree on:

* which values are containers: dataclass instances, dicts, lists, tuples (named tuples included),
  sets and frozensets; everything else is a leaf the caller handles;
* the field path that names a value in messages and in a step's version (``model.d_model``,
  ``weights["web code"]``, ``layers[3]``); a non-str dict key is written as its canonical encoding,
  so the path is the same in every process (never a ``repr`` that depends on ``PYTHONHASHSEED``);
* the limits: a config nested deeper than :data:`MAX_DEPTH` or one that contains itself is refused
  with a :class:`ConfigStructureError` naming the field, never a raw ``RecursionError``.

A walk is ``walk(value, visit, build)``: ``visit(value, path)`` is called first on every value and
returns either a result or :data:`DESCEND`; for a container that it descends into, the children are
walked and ``build(value, kind, children, path)`` combines their results.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Callable

MAX_DEPTH = 100
"""Deepest nesting a config may have. Real configs are a few levels deep; a deeper one is almost
certainly a mistake (or a cycle) and would otherwise end in a RecursionError."""

DESCEND = object()
"""Returned by a visitor to say "walk into this container"."""

# edge kinds of a field path; GROUP: a dataclass field declared a group of its parent's fields
ATTR, KEY, INDEX, MEMBER, GROUP = "attr", "key", "index", "member", "group"

VERSIONING_RULE = "marin_versioning"
"""The dataclass field-metadata key of the versioning rule (:mod:`marin.execution.versioning` sets it)."""


def is_group(f: dataclasses.Field) -> bool:
    """Whether ``f`` was declared with :func:`marin.execution.versioning.group`: a nested config whose
    fields are spelled ``parent.group.field`` but named ``parent.field`` in a step's version."""
    return (f.metadata.get(VERSIONING_RULE) or ("",))[0] == "group"


class UnhashableConfigError(TypeError):
    """A versioned config value has no canonical encoding (wrong type, NaN, unencodable dict key)."""


class ConfigStructureError(UnhashableConfigError):
    """A config is nested too deeply or contains itself."""


class FieldPath:
    """Where a value sits in a config: a linked list of edges, rendered to text only when needed.

    ``str(path)`` gives ``opt.lr``, ``weights["web code"]``, ``layers[3]``; the root is ``""`` (or
    the text prefix it was created with). Rendering raises :class:`UnhashableConfigError` when an edge
    is a dict key without a canonical encoding, because such a path cannot name a versioned value.
    """

    __slots__ = ("parent", "kind", "key", "depth", "_text", "key_text")

    def __init__(self, parent: "FieldPath | None" = None, kind: str = "", key: Any = None, text: str | None = None,
                 key_text: "Callable[[Any], str] | None" = None):
        self.parent, self.kind, self.key = parent, kind, key
        self.depth = 0 if parent is None else parent.depth + 1
        self._text = text
        self.key_text = parent.key_text if parent is not None else key_text
        """How a non-str dict key or a set member is named: the canonical encoding's text
        (``marin.execution.hashing.key_text``), given by the walk's caller; None: it cannot be named."""

    @staticmethod
    def root(text: str = "", key_text: "Callable[[Any], str] | None" = None) -> "FieldPath":
        return FieldPath(text=text, key_text=key_text)

    def child(self, kind: str, key: Any) -> "FieldPath":
        return FieldPath(self, kind, key)

    @property
    def name(self) -> str:
        """The last component as a plain name (attribute or str key), else ``""``: what masking reads."""
        if self.kind in (ATTR, GROUP) or (self.kind == KEY and isinstance(self.key, str)):
            return self.key
        return ""

    def __str__(self) -> str:
        if self._text is None:
            self._text = _join(str(self.parent), self.kind, self.key, self.key_text)
        return self._text

    def version_name(self) -> str:
        """The path as a step's version names it: a group's fields as its parent's own
        (``optimizer.peak_lr`` is named ``peak_lr``), so grouping the fields of a flat config moves
        no hash."""
        node, in_group = self, False
        while node is not None and not in_group:
            in_group, node = node.kind == GROUP, node.parent
        if not in_group:
            return str(self)
        parent = self.parent.version_name()
        if self.kind == GROUP:
            return parent
        return _join(parent, self.kind, self.key, self.key_text)

    def describe(self) -> str:
        """The path for messages: never raises, ``<root>`` for the root, long paths shortened."""
        try:
            text = str(self) or "<root>"
        except UnhashableConfigError:
            parent = self.parent.describe() if self.parent is not None else ""
            text = f"{'' if parent == '<root>' else parent}[{self.key!r:.60}]"
        return text if len(text) <= 160 else f"{text[:80]}...{text[-60:]}"

    def __repr__(self) -> str:
        return f"FieldPath({self.describe()!r})"

    def keys(self) -> tuple[Any, ...]:
        """The attribute names, dict keys and indices from the root to here (what :func:`path_keys` reads
        back from the text): two spellings of one field, ``model.d_model`` and ``model["d_model"]``,
        have the same keys."""
        out, node = [], self
        while node is not None and node.parent is not None:
            out.append(node.key)
            node = node.parent
        return tuple(reversed(out))


def join_attr(path: str, name: str) -> str:
    """Field path of attribute ``name`` under ``path`` (``model.d_model``)."""
    return f"{path}.{name}" if path else name


def join_key(path: str, key: str) -> str:
    """Field path of dict key ``key`` under ``path`` (``weights["web code"]``); unambiguous for any key.

    Keys of a top-level dict config read like attributes (``opt``) when they are identifiers."""
    if not path and key.isidentifier():
        return key
    return f"{path}[{json.dumps(key)}]"


_IDENTIFIER = re.compile(r"\.?([A-Za-z_][A-Za-z0-9_]*)")
_DECODER = json.JSONDecoder()


def path_keys(text: str) -> tuple[Any, ...]:
    """The keys a field path names (the inverse of the spelling above): ``model.d_model`` and
    ``model["d_model"]`` both give ``("model", "d_model")``, ``layers[3]`` gives ``("layers", 3)``; a
    key written as its canonical encoding (``[{"set":["a","b"]}]``) comes back as that encoding's text.

    A recorded config is JSON, where a dataclass field and a dict key look alike; comparing keys
    rather than text lets a recorded leaf be matched against the version's field paths."""
    out: list[Any] = []
    pos = 0
    while pos < len(text):
        m = _IDENTIFIER.match(text, pos)
        if m is not None:
            out.append(m.group(1))
            pos = m.end()
            continue
        if text[pos] not in "[{":
            raise ValueError(f"not a field path: {text!r} (at {text[pos:pos + 20]!r})")
        close = "]" if text[pos] == "[" else "}"
        try:
            key, end = _DECODER.raw_decode(text, pos + 1)
        except json.JSONDecodeError:
            raise ValueError(f"not a field path: {text!r} (at {text[pos:pos + 20]!r})") from None
        if end >= len(text) or text[end] != close:
            raise ValueError(f"not a field path: {text!r} (at {text[pos:pos + 20]!r})")
        out.append(key if isinstance(key, (str, int)) and close == "]" else text[pos + 1:end])
        pos = end + 1
    return tuple(out)


def _join(parent: str, kind: str, key: Any, key_text: "Callable[[Any], str] | None") -> str:
    if kind in (ATTR, GROUP):
        return join_attr(parent, key)
    if kind == KEY and isinstance(key, str):
        return join_key(parent, key)
    if kind == INDEX:
        return f"{parent}[{key}]"
    if key_text is None:
        raise UnhashableConfigError(f"{type(key).__name__} key {key!r:.60} cannot be named without its encoding")
    if kind == KEY:
        return f"{parent}[{key_text(key)}]"
    return f"{parent}{{{key_text(key)}}}"  # MEMBER of a set, named by its own encoding


def container_kind(value: Any) -> str | None:
    """``"dataclass" | "dict" | "list" | "tuple" | "set"``, or None for a leaf."""
    if isinstance(value, dict):
        return "dict"
    if isinstance(value, list):
        return "list"
    if isinstance(value, tuple):
        return "tuple"
    if isinstance(value, (set, frozenset)):
        return "set"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return "dataclass"
    return None


def children(value: Any, kind: str) -> list[tuple[str, Any, Any]]:
    """``(edge kind, key, child)`` of a container, in a deterministic order (sets: by encoding later)."""
    if kind == "dataclass":
        return [(GROUP if is_group(f) else ATTR, f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
    if kind == "dict":
        return [(KEY, k, v) for k, v in value.items()]
    if kind in ("list", "tuple"):
        return [(INDEX, i, v) for i, v in enumerate(value)]
    return [(MEMBER, v, v) for v in value]


Visit = Callable[[Any, FieldPath], Any]
Build = Callable[[Any, str, list[tuple[str, Any, Any]], FieldPath], Any]


def walk(value: Any, visit: Visit, build: Build, path: FieldPath | str | None = None,
         key_text: Callable[[Any], str] | None = None) -> Any:
    """Walk ``value`` depth first (see the module docstring); ``path`` names ``value`` itself.
    ``key_text`` names non-str dict keys and set members in paths (the caller's canonical encoding,
    :func:`marin.execution.hashing.key_text`; a path given as a FieldPath carries its own)."""
    if not isinstance(path, FieldPath):
        path = FieldPath.root(path or "", key_text)
    return _walk(value, visit, build, path, set())


def _walk(value: Any, visit: Visit, build: Build, path: FieldPath, on_stack: set[int]) -> Any:
    result = visit(value, path)
    if result is not DESCEND:
        return result
    kind = container_kind(value)
    if kind is None:
        raise TypeError(f"visitor asked to descend into a {type(value).__name__}, which is not a container")
    if path.depth >= MAX_DEPTH:
        raise ConfigStructureError(
            f"config field {path.describe()} is nested more than {MAX_DEPTH} levels deep; flatten the config "
            "(deeply nested configs are refused so that hashing and rendering stay predictable)"
        )
    if id(value) in on_stack:
        raise ConfigStructureError(f"config field {path.describe()} contains itself (a reference cycle)")
    on_stack.add(id(value))
    try:
        out = [(edge, key, _walk(child, visit, build, path.child(edge, key), on_stack))
               for edge, key, child in children(value, kind)]
    finally:
        on_stack.discard(id(value))
    return build(value, kind, out, path)


def leaves(value: Any, key_text: Callable[[Any], str] | None = None) -> list[tuple[FieldPath, Any]]:
    """``(path, value)`` of every leaf of a config (an empty container is a leaf), in walk order."""
    out: list[tuple[FieldPath, Any]] = []

    def visit(v: Any, path: FieldPath) -> Any:
        if container_kind(v) is not None and len(v if not dataclasses.is_dataclass(v) else dataclasses.fields(v)):
            return DESCEND
        out.append((path, v))
        return None

    walk(value, visit, lambda *_: None, key_text=key_text)
    return out
