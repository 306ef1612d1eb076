"""Device mesh with axes ("data", "expert").

Tokens are split over both axes (every device holds different sequences). Expert weights are split
over "expert": one "data" row of the mesh is one EP group (a rack in the hero run: EP 64, data 11).
The other parameters are replicated, or, with ``param_sharding="fsdp"``, split over the mesh too
(the rule, JAX-free, is marin.parallel.layout).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from marin.parallel.layout import DATA, EXPERT, PARAM_SHARDINGS, leaf_partition  # noqa: F401
from marin.parallel.roles import leaf_role

TOKEN_AXES = (DATA, EXPERT)  # the batch / token dimension is split over both axes


def make_mesh(data: int, expert: int, devices=None) -> Mesh:
    """A (data, expert) mesh over the first data*expert devices.

    Uses jax.sharding.Mesh directly (jax.make_mesh defaults to explicit axis types, which shard_map
    with unsharded inputs rejects)."""
    devices = list(jax.devices() if devices is None else devices)
    n = data * expert
    if n > len(devices):
        raise ValueError(f"mesh data={data} x expert={expert} needs {n} devices, have {len(devices)}")
    return Mesh(np.array(devices[:n]).reshape(data, expert), (DATA, EXPERT))


def batch_sharding(mesh: Mesh, context_parallel: int = 1) -> NamedSharding:
    """Sharding of a [B, L+1] token batch: B split over data x expert (B must divide evenly). With
    context parallelism C > 1 a step has C times fewer sequences than devices can take whole, so B
    splits over "data" only (every device of a rack holds its rack's token ids, int32: 33 MB for the
    hero's 16 sequences of 262K per rack) and the step cuts each device's shards out of them."""
    return NamedSharding(mesh, P(TOKEN_AXES if context_parallel == 1 else DATA, None))


def param_shardings(params, mesh: Mesh, mode: str = "replicated"):
    """A pytree of NamedShardings matching `params` (from transformer.init_params), or any tree whose
    leaves sit under the params' keys (AdamW's moments mirror the params; its step count is a scalar
    and replicates). ``mode``: "replicated" or "fsdp" (marin.parallel.layout.leaf_partition)."""
    mesh_shape = (mesh.shape[DATA], mesh.shape[EXPERT])

    def spec(path, leaf):
        keys = [getattr(k, "key", None) for k in path]
        name = keys[-1] if keys else None
        shape = tuple(getattr(leaf, "shape", ()))
        role = leaf_role(str(name), shape)  # by the model's parameter table (marin.parallel.roles)
        return NamedSharding(mesh, P(*leaf_partition(role, shape, mesh_shape, mode, "blocks" in keys)))

    return jax.tree_util.tree_map_with_path(spec, params)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def place_host_arrays(tree, shardings):
    """Host arrays -> global jax Arrays with ``shardings`` (a pytree of them, or one for every leaf);
    works across processes: each process hands over only the slices its devices hold. Leaves that
    are already global arrays on the same mesh (the trainer's state, in whatever layout) pass through
    untouched. For small host-built values (batches, eval rows, test states): the training state
    itself never exists whole on a host."""

    def one(a, s):
        if isinstance(a, jax.Array) and (a.sharding == s or getattr(a.sharding, "mesh", None) == s.mesh):
            return a
        a = np.asarray(a)
        return jax.make_array_from_callback(a.shape, s, lambda idx: a[idx])

    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda a: one(a, shardings), tree)
    return jax.tree.map(one, tree, shardings)
