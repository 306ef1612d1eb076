"""Code fingerprints: recorded in step info, compared in dry runs and ``marin explain``.

The step function's code is deliberately *not* part of the hash (a refactor must not invalidate a
week of training), but a changed function is worth a warning.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from typing import Any, Callable


@functools.lru_cache(maxsize=256)
def _file_digest(path: str | None) -> str | None:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:16]
    except OSError:
        return None


_cache: dict[int, dict[str, Any]] = {}


def code_fingerprint(fn: Callable) -> dict[str, Any]:
    """``{"fn": qualified name, "source": sha of fn source, "module": sha of its module file}``."""
    key = id(fn)
    if key in _cache:
        return _cache[key]
    try:
        source = hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        source = None
    module = getattr(fn, "__module__", None) or "?"
    out = {
        "fn": f"{module}.{getattr(fn, '__qualname__', repr(fn))}",
        "source": source,
        "module": _file_digest(getattr(getattr(fn, "__code__", None), "co_filename", None)),
    }
    _cache[key] = out
    return out


def drift(recorded: dict[str, Any] | None, current: dict[str, Any]) -> str | None:
    """A human sentence if the code changed since ``recorded``, else None."""
    if not recorded:
        return None
    if recorded.get("fn") != current.get("fn"):
        return f"step function changed from {recorded.get('fn')} to {current.get('fn')}"
    if recorded.get("source") and current.get("source") and recorded["source"] != current["source"]:
        return f"source of {current['fn']} changed since the recorded run"
    if recorded.get("module") and current.get("module") and recorded["module"] != current["module"]:
        return f"module of {current['fn']} changed since the recorded run (function body unchanged)"
    return None
