"""Device mesh with axes ("data", "expert").

Tokens are split over both axes (every device holds different sequences). Expert weights are split
over "expert" and replicated over "data": one "data" row of the mesh is one EP group (a rack in the
hero run: EP 64, data 11). All other parameters are replicated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA, EXPERT = "data", "expert"
TOKEN_AXES = (DATA, EXPERT)  # the batch / token dimension is split over both axes

# parameter leaves (under params["blocks"]) whose axis 1 (after the stacked-layer axis) is the expert axis
EXPERT_LEAVES = ("expert_gate", "expert_up", "expert_down")


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


def make_mesh(data: int, expert: int, devices=None) -> Mesh:
    """A (data, expert) mesh over the first data*expert devices.

    Uses jax.sharding.Mesh directly (jax.make_mesh defaults to explicit axis types, which shard_map
    with unsharded inputs rejects)."""
    devices = list(jax.devices() if devices is None else devices)
    n = data * expert
    if n > len(devices):
        raise ValueError(f"mesh data={data} x expert={expert} needs {n} devices, have {len(devices)}")
    return Mesh(np.array(devices[:n]).reshape(data, expert), (DATA, EXPERT))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a [B, L+1] token batch: B split over data x expert (B must divide evenly)."""
    return NamedSharding(mesh, P(TOKEN_AXES, None))


def param_shardings(params, mesh: Mesh):
    """A pytree of NamedShardings matching `params` (from transformer.init_params)."""

    def spec(path, leaf):
        name = getattr(path[-1], "key", None)
        if name in EXPERT_LEAVES:
            return NamedSharding(mesh, P(None, EXPERT, *([None] * (leaf.ndim - 2))))
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(spec, params)


def shard_params(params, mesh: Mesh):
    return jax.device_put(params, param_shardings(params, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


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
