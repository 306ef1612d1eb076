"""Small JAX helpers that hide differences between JAX releases (0.10 here, 0.11 on GPU images).

They sit below both :mod:`marin.kernels` and :mod:`marin.parallel`, so neither has to import the other.
"""

from __future__ import annotations

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
