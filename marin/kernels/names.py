"""The names of the grouped expert compute implementations, without JAX (the training config
checks a run's `parallelism.grouped_impl` with them, and it is imported by experiment files and the
CLI, which must stay cheap). What each one does is in :mod:`marin.kernels.grouped`."""

from __future__ import annotations

GROUPED_IMPLS = ("capacity", "ragged_dot", "tokamax")
"""The grouped-compute implementations, by name; a run's config takes one of them or "auto"."""

GROUPED_IMPL_ALIASES = {"ragged": "ragged_dot"}
"""Names of before, still read: "ragged" meant `jax.lax.ragged_dot`, renamed so it is not confused
with the `ragged` transport."""


def canonical_grouped_impl(name: str) -> str:
    """``name`` ("auto", an implementation, or an old alias) as the name it is now; an unknown one
    is refused in one line (ValueError)."""
    name = GROUPED_IMPL_ALIASES.get(name, name)
    if name != "auto" and name not in GROUPED_IMPLS:
        raise ValueError(f"unknown grouped_impl {name!r}; choose from {', '.join(('auto', *GROUPED_IMPLS))}")
    return name


__all__ = ["GROUPED_IMPLS", "GROUPED_IMPL_ALIASES", "canonical_grouped_impl"]
