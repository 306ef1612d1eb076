"""Device mesh with axes ("data", "expert").

Tokens are split over both axes (every device holds different sequences). Expert weights are split
over "expert" and replicated over "data": one "data" row of the mesh is one EP group (a rack in the
hero run: EP 64, data 11). All other parameters are replicated.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA, EXPERT = "data", "expert"
TOKEN_AXES = (DATA, EXPERT)  # the batch / token dimension is split over both axes

# parameter leaves (under params["blocks"]) whose axis 1 (after the stacked-layer axis) is the expert axis
EXPERT_LEAVES = ("expert_gate", "expert_up", "expert_down")


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


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
