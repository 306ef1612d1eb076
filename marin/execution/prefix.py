"""Where outputs go when nobody says: the one home of the default-prefix rule.

``executor_main``, the review commands and :mod:`marin.review` all resolve a prefix here, so an
experiment run without ``--prefix`` and ``marin status`` without ``--prefix`` look at the same place.
"""

from __future__ import annotations

import os

from marin.execution.plan import normalize_prefix

DEFAULT_PREFIX = "local_store"
"""Used when neither ``--prefix`` nor ``$MARIN_PREFIX`` is set (relative to the working directory)."""


def resolve_prefix(prefix: str | None = None) -> str:
    """``prefix``, else ``$MARIN_PREFIX``, else ``./local_store``; normalised (absolute, no trailing slash)."""
    return normalize_prefix(prefix or os.environ.get("MARIN_PREFIX") or DEFAULT_PREFIX)
