"""Turn configs into JSON for step info, experiment records, logs and W&B, masking secrets, and
read such a record back into its dataclass (:func:`from_jsonable`).

This is for humans and review tools, not for hashing (see :mod:`marin.execution.hashing`): any value
is accepted and unknown types fall back to ``repr``. It walks configs with the same traversal as
hashing and placeholder resolution (:mod:`marin.execution.walker`).

The masking rule, the one used everywhere a config or an error message leaves the process:

* a field (dataclass attribute or dict key) whose name has a word meaning secret (``api_key``,
  ``hfToken``, ``db_password``, ``aws_secret_access_key``, ``credentials``) is replaced by ``***``
  whatever its value (words are whole: ``tokenizer`` and ``tokens_per_step`` are not secrets);
* any string, under any field, has credential-looking parts replaced by ``***``: AWS access key ids
  (``AKIA``/``ASIA`` + 16 upper-case letters or digits), W&B API keys (40 hex digits; a git commit
  id reads the same and is masked too), ``sk-...``, ``hf_...``, ``ghp_...``, ``github_pat_...`` tokens, and
  40-character base64 AWS secret keys under a field whose name mentions aws/access/auth/cred;
* credentials in other shapes, wherever they appear in a string: the user-info part of a URL
  (``https://user:pass@host/x`` -> ``https://***@host/x``), the value of an authorization-like
  header (``Authorization: Bearer ...``, ``X-Api-Key: ...``, also as JSON or ``key=value``), a
  ``Bearer``/``Basic`` credential on its own, and credential query parameters of a URL
  (``?access_token=...``, ``X-Amz-Signature=...``). A field named ``authorization`` is a secret.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import pathlib
import re
import types as types_module
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from marin.execution.hashing import is_added_later, key_text, value_before
from marin.execution.step import VersionedValue
from marin.execution.walker import DESCEND, FieldPath, container_kind, walk
from marin.execution.walker import UnhashableConfigError as _Unencodable

T = TypeVar("T")

MASK = "***"
_SECRET_WORDS = {"key", "secret", "token", "password", "passwd", "apikey", "credential", "credentials",
                 "authorization"}
_KEYISH_WORDS = _SECRET_WORDS | {"aws", "access", "auth", "cred", "creds", "s3", "env", "environment"}
_WORD_SPLIT = re.compile(r"[^A-Za-z0-9]+|(?<=[a-z0-9])(?=[A-Z])")

_CREDENTIAL_RE = re.compile(
    r"(?<![A-Za-z0-9])(?:"
    r"(?:AKIA|ASIA)[A-Z0-9]{16}"  # AWS access key id
    r"|[0-9a-f]{40}"  # W&B API key
    r"|sk-[A-Za-z0-9_\-]{16,}"  # OpenAI-style secret keys
    r"|hf_[A-Za-z0-9]{20,}"  # Hugging Face tokens
    r"|gh[pousr]_[A-Za-z0-9]{16,}"  # GitHub tokens (36 characters after the prefix when issued)
    r"|github_pat_[A-Za-z0-9_]{20,}"  # GitHub fine-grained personal access tokens
    r")(?![A-Za-z0-9])"
)
_AWS_SECRET_RE = re.compile(r"(?<![A-Za-z0-9/+=])[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])")
_URL_USERINFO_RE = re.compile(r"(?<=://)[^/\s@:'\"<>]+(?::[^/\s@'\"<>]*)?@")
"""``user:password@`` (or ``token@``) right after a URL's scheme."""
_AUTH_HEADER_RE = re.compile(
    r"(?i)((?:proxy-)?authorization|x-api-key|api-key|x-auth-token|x-goog-api-key|private-token)"
    r"(\"?\s*[:=]\s*\"?)(?:(bearer|basic|token|digest)\s+)?[^\s\"',;}]+"
)
"""An authorization-like header and its value, as ``Name: value``, ``"Name": "value"`` or ``name=value``."""
_BEARER_RE = re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{8,}")
_QUERY_SECRET_RE = re.compile(
    r"(?i)([?&](?:access_token|id_token|refresh_token|token|api_key|apikey|key|sig|signature|password"
    r"|x-amz-signature|x-amz-credential|x-amz-security-token|x-goog-signature|x-goog-credential)=)[^&\s\"'#]+"
)


def _words(name: str) -> set[str]:
    return {w.lower() for w in _WORD_SPLIT.split(name) if w}


def is_secret_field(name: str) -> bool:
    """True if a field name says it holds a secret (``api_key``, ``hfToken``, ``db_password``).

    Matching is by whole word so ``tokenizer`` or ``tokens_per_step`` are not masked.
    """
    return bool(_words(name) & _SECRET_WORDS)


def mask_text(text: str, field_name: str = "", *, keyish: bool | None = None) -> str:
    """``text`` with every credential-looking part replaced by ``***`` (see the module docstring).

    Use it on anything free-form that may quote a config: error messages, tracebacks, argv.
    ``keyish`` (default: whether ``field_name`` mentions aws/access/auth/cred/...) also masks
    40-character base64 strings, the shape of an AWS secret access key."""
    if not text:
        return text
    out = _CREDENTIAL_RE.sub(MASK, text)
    if "@" in out:
        out = _URL_USERINFO_RE.sub(MASK + "@", out)
    out = _AUTH_HEADER_RE.sub(lambda m: m.group(1) + m.group(2) + (m.group(3) + " " if m.group(3) else "") + MASK,
                              out)
    out = _BEARER_RE.sub(lambda m: f"{m.group(1)} {MASK}", out)
    if "=" in out:
        out = _QUERY_SECRET_RE.sub(lambda m: m.group(1) + MASK, out)
    if keyish is None:
        keyish = bool(field_name) and bool(_words(field_name) & _KEYISH_WORDS)
    if keyish:
        out = _AWS_SECRET_RE.sub(lambda m: MASK if _mixed(m.group(0)) else m.group(0), out)
    return out


MASKED_LOGGERS = ("marin", "experiments", "operations", "__main__")
"""The loggers whose records :func:`mask_log_records` masks: marin's own, the experiment files' and
operator scripts' (a step's function logs what it fetches from where)."""


def mask_log_records() -> None:
    """Make every log record of :data:`MASKED_LOGGERS` (and their children) pass through
    :func:`mask_text` when it is made, message and traceback, whatever handler later shows or stores
    it: the terminal, a Ray worker's log a driver echoes, a file. A log record factory, not a filter:
    a filter sits on one logger or handler, and a record propagated from a child logger skips its
    ancestors' filters. Called by the entry points (the ``marin`` command, the executor's driver and
    each step's task), never on import; installing it twice is a no-op, and the factory that was in
    place keeps making the records."""
    previous = logging.getLogRecordFactory()
    if getattr(previous, "masks_secrets", False):
        return

    def make(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        name = record.name
        if not any(name == n or name.startswith(n + ".") for n in MASKED_LOGGERS):
            return record
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is the handler's to report, as without masking
            return record
        masked = mask_text(text)
        if masked != text:
            record.msg, record.args = masked, None
        if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
            record.exc_text = mask_text(logging.Formatter().formatException(record.exc_info))
        return record

    make.masks_secrets = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(make)


def _keyish_path(path: FieldPath) -> bool:
    """Whether any field on ``path`` has a name mentioning credentials (``aws.base``, ``auth["x"]``)."""
    node: FieldPath | None = path
    while node is not None:
        if node.name and _words(node.name) & _KEYISH_WORDS:
            return True
        node = node.parent
    return False


def _mask_str(text: str, path: FieldPath) -> str:
    keyish = _AWS_SECRET_RE.search(text) is not None and _keyish_path(path)
    return mask_text(text, keyish=keyish)


def _mixed(s: str) -> bool:
    """A random base64 secret has upper, lower and digits; a word or a path does not, usually."""
    return any(c.isupper() for c in s) and any(c.islower() for c in s) and any(c.isdigit() for c in s)


def _render_leaf(value: Any, path: FieldPath) -> Any:
    name = path.name
    if name and value is not None and is_secret_field(name):
        return MASK
    if value is None or isinstance(value, (bool, int)) and not isinstance(value, enum.Enum):
        return value
    if isinstance(value, str):
        return _mask_str(value, path)
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, pathlib.PurePath):
        return _mask_str(str(value), path)
    if container_kind(value) is not None:
        return DESCEND
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    return _mask_str(repr(value), path)


def _render_container(value: Any, kind: str, items: list[tuple[str, Any, Any]], path: FieldPath) -> Any:
    if kind in ("dataclass", "dict"):
        return {(k if isinstance(k, str) else _key_text(k)): v for _, k, v in items}
    if kind == "set":
        return sorted((v for _, _, v in items), key=repr)
    return [v for _, _, v in items]


def _key_text(key: Any) -> str:
    try:
        return mask_text(key_text(key))
    except _Unencodable:
        return mask_text(repr(key))


def to_jsonable(value: Any, *, field_name: str = "") -> Any:
    """A JSON-compatible rendering of ``value`` with secrets masked (the rule in the module docstring).

    ``field_name`` is the name ``value`` sits under, if any (a secret name masks it whole)."""
    root = FieldPath.root(key_text=key_text)
    path = root.child("key", field_name) if field_name else root
    return walk(value, _render_leaf, _render_container, path)


mask_secrets = to_jsonable
"""The public name for callers outside the executor (trainer config records, W&B config)."""


def mask_leaves(leaves: dict[str, Any]) -> dict[str, Any]:
    """Mask encoded versioned leaves (field path -> encoded value) by the same rule.

    The last component of the path is the field name; string parts of the encoding are scanned for
    credential-looking values. Masking a record never changes a hash: hashes are computed before."""
    out = {}
    for path, value in leaves.items():
        last = re.split(r"[.\[\]\"{}]+", path.strip('"]}'))[-1] if path else ""
        out[path] = to_jsonable(value, field_name=last)
    return out


def mask_argv(argv: list[str]) -> list[str]:
    """A command line with secret flags (``--api_key X``, ``--hf_token=X``) and credential-looking
    values masked, for experiment records and logs."""
    out: list[str] = []
    secret_next = False
    for arg in argv:
        if secret_next:
            out.append(MASK)
            secret_next = False
            continue
        name, eq, value = arg.partition("=")
        flag = name.lstrip("-")
        if arg.startswith("-") and flag and is_secret_field(flag):
            if eq:
                out.append(f"{name}={MASK}")
            else:
                out.append(arg)
                secret_next = True
            continue
        out.append(mask_text(arg, flag if eq else ""))
    return out


# ---- reading a rendered config back -------------------------------------------------------------------
class ConfigRecordError(ValueError):
    """A recorded config that does not read back as its dataclass (one line naming the field)."""


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """``cls``'s field types, resolved from their string annotations once per class."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def from_jsonable(cls: type[T], data: Any, *, types: Mapping[str, Any] | None = None,
                  ignore_unknown: bool = False) -> T:
    """The inverse of :func:`to_jsonable` for a dataclass: ``cls`` built from a recorded config
    (a dict as JSON holds it), field by field, led by the field types.

    One reader for every recorded config, so a field added to a config is read back without a
    reader to keep in step with it. Nested dataclasses, ``X | None``, unions (a dict picks the
    dataclass member whose fields it names; a scalar the member of its type), ``tuple[X, ...]`` and
    fixed tuples (JSON lists), lists, sets, dicts (non-str keys read back from their text), enums
    (``Name.MEMBER`` as rendered, or the member's name or value), floats rendered as ``'nan'`` /
    ``'inf'``, and paths; a :class:`~marin.execution.step.VersionedValue` anywhere is unwrapped (an
    experiment's declared config reads as the step's function sees it), and a dataclass instance
    reads like its fields. A missing field takes its default, except one added to the config later
    (``added_later``), which reads as what records written before it did (its ``before``).
    ``types``: the type to read a field as where its annotation says too little (``Any``), by dotted
    field path (``{"data": MixtureConfig | SyntheticDataConfig}``).
    ``ignore_unknown``: skip recorded fields ``cls`` no longer has (a record of an older version of
    the config), else refuse them. Masked secrets read back as the mask (``***``): a record never
    holds them. Raises :class:`ConfigRecordError` naming the field path."""
    return _read(cls, data, "", dict(types or {}), ignore_unknown)


def _where(path: str) -> str:
    return f"field {path}" if path else "the record"


def _read(tp: Any, value: Any, path: str, types: dict[str, Any], ignore_unknown: bool) -> Any:
    while isinstance(value, VersionedValue):
        value = value.value
    if tp is Any or tp is object:
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or origin is types_module.UnionType:
        return _read_union(args, value, path, types, ignore_unknown)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _read_dataclass(tp, value, path, types, ignore_unknown)
    if origin in (tuple, list, set, frozenset) or tp in (tuple, list, set, frozenset):
        if not isinstance(value, (list, tuple, set, frozenset)):
            raise ConfigRecordError(f"{_where(path)}: expected a list, got {value!r}")
        items = list(value)
        kind = origin or tp
        if kind is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            if len(args) != len(items):
                raise ConfigRecordError(f"{_where(path)}: expected {len(args)} items, got {len(items)}")
            return tuple(_read(a, v, f"{path}[{i}]", types, ignore_unknown)
                         for i, (a, v) in enumerate(zip(args, items)))
        item = args[0] if args else Any
        return kind(_read(item, v, f"{path}[{i}]", types, ignore_unknown) for i, v in enumerate(items))
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigRecordError(f"{_where(path)}: expected a mapping, got {value!r}")
        key_tp, value_tp = args if args else (Any, Any)
        return {_read_key(key_tp, k, path): _read(value_tp, v, f"{path}[{k!r}]", types, ignore_unknown)
                for k, v in value.items()}
    if origin is typing.Literal:
        if value not in args:
            raise ConfigRecordError(f"{_where(path)}: expected one of {list(args)}, got {value!r}")
        return value
    if tp is type(None):
        if value is not None:
            raise ConfigRecordError(f"{_where(path)}: expected None, got {value!r}")
        return None
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _read_enum(tp, value, path)
    if tp is float:
        if isinstance(value, str) and value in ("nan", "inf", "-inf"):
            return float(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is int or tp is bool or tp is str:
        if type(value) is tp or (tp is int and isinstance(value, int) and not isinstance(value, bool)):
            return value
    elif isinstance(tp, type) and issubclass(tp, pathlib.PurePath):
        if isinstance(value, (str, pathlib.PurePath)):
            return tp(value)
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    name = getattr(tp, "__name__", str(tp))
    raise ConfigRecordError(f"{_where(path)}: expected {name}, got {value!r}")


def _read_union(args: tuple[Any, ...], value: Any, path: str, types: dict[str, Any], ignore_unknown: bool) -> Any:
    if value is None and type(None) in args:
        return None
    members = [a for a in args if a is not type(None)]
    if isinstance(value, Mapping):  # the dataclass whose fields the record names, before any other
        classes = [a for a in members if dataclasses.is_dataclass(a)]
        exact = [c for c in classes if set(value) <= {f.name for f in dataclasses.fields(c)}]
        members = exact + [m for m in members if m not in exact]
    errors = []
    for member in members:
        try:
            return _read(member, value, path, types, ignore_unknown)
        except ConfigRecordError as e:
            errors.append(str(e))
    names = [getattr(m, "__name__", str(m)) for m in members]
    raise ConfigRecordError(errors[0] if len(errors) == 1 else f"{_where(path)}: {value!r} reads as none of {names}")


def _read_dataclass(cls: type, value: Any, path: str, types: dict[str, Any], ignore_unknown: bool) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if not isinstance(value, Mapping):
        raise ConfigRecordError(f"{_where(path)}: expected {cls.__name__} fields, got {value!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(value) - set(fields))
    if unknown and not ignore_unknown:
        raise ConfigRecordError(f"{_where(path)}: {cls.__name__} has no field {unknown[0]!r}")
    hints = _hints(cls)
    kwargs = {}
    for name, f in fields.items():
        sub = f"{path}.{name}" if path else name
        if name in value:
            kwargs[name] = _read(types.get(sub, hints.get(name, Any)), value[name], sub, types, ignore_unknown)
        elif is_added_later(f):  # recorded before the field existed: what those records did
            kwargs[name] = value_before(f)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigRecordError(f"{_where(sub)}: missing from the record ({cls.__name__} has no default for it)")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigRecordError(f"{_where(path)}: {cls.__name__} refused the record: {e}") from None


def _read_key(tp: Any, key: Any, path: str) -> Any:
    if tp in (Any, str) or isinstance(key, tp if isinstance(tp, type) else ()):
        return key
    if tp is int:
        try:
            return int(key)
        except ValueError:
            pass
    elif tp is float:
        try:
            return float(key)
        except ValueError:
            pass
    raise ConfigRecordError(f"{_where(path)}: key {key!r} does not read as {getattr(tp, '__name__', tp)}")


def _read_enum(cls: type[enum.Enum], value: Any, path: str) -> enum.Enum:
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        name = value.removeprefix(f"{cls.__name__}.")
        if name in cls.__members__:
            return cls[name]
    try:
        return cls(value)
    except ValueError:
        raise ConfigRecordError(f"{_where(path)}: {value!r} is no {cls.__name__} "
                                f"(one of {list(cls.__members__)})") from None
