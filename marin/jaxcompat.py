"""Small JAX helpers that hide differences between JAX releases (0.10 here, 0.11 on GPU images).

They sit below both :mod:`marin.kernels` and :mod:`marin.parallel`, so neither has to import the other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax


def varying_axes(a) -> set:
    """The shard_map mesh axes `a` varies over (empty outside shard_map)."""
    t = jax.typeof(a)
    mat = getattr(t, "manual_axis_type", None)  # jax 0.10; older releases call it .vma
    return set(mat.varying) if mat is not None else set(getattr(t, "vma", ()))


def vary_like(x, *refs):
    """Inside shard_map, mark a fresh array (e.g. a loop's zero init, a custom call's operand) as
    varying over the same mesh axes as `refs`, so that values meeting in one op have one type."""
    missing = tuple(sorted(set().union(*(varying_axes(r) for r in refs)) - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def sum_to_type_of(ct, primal):
    """A cotangent varying over more mesh axes than its primal is summed over the extra ones (the
    transpose of the implicit broadcast of a replicated input, e.g. expert weights over "data")."""
    extra = tuple(sorted(varying_axes(ct) - varying_axes(primal)))
    return jax.lax.psum(ct, extra) if extra else ct


_LOWERING_FOR: list[str] = []


def compute_platform() -> str:
    """The platform the program being traced will run on: this process's default backend, or the one
    an enclosing `lowering_for` names. Platform-specific choices (CPU kernels, the grouped-matmul
    implementation, the emulated ragged all_to_all) ask this, not the process, so a CPU-only machine
    traces exactly the program a GPU host would run."""
    return _LOWERING_FOR[-1] if _LOWERING_FOR else jax.default_backend()


@contextlib.contextmanager
def lowering_for(platform: str) -> Iterator[None]:
    """Trace for ``platform`` ("cuda", "rocm", "cpu", ...) inside this block (e.g. to lower the GPU
    train step with ``lowering_platforms=("cuda",)`` on a machine without a GPU)."""
    _LOWERING_FOR.append("gpu" if platform in ("cuda", "rocm") else platform)
    try:
        yield
    finally:
        _LOWERING_FOR.pop()
