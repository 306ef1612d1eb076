"""Where each parameter leaf lives on the (data, expert) mesh: the sharding rule, JAX-free.

Two modes (``TrainConfig.parallelism.param_sharding``):

``"replicated"``
    Routed-expert weights ``[layers, experts, ...]`` split their expert axis over "expert" (one "data"
    row of the mesh is one EP group); every other leaf is a full copy on every device. Simple, and
    the only layout that fits small models on few devices without any gather.

``"fsdp"``
    Fully sharded data parallelism (ZeRO-3): every weight matrix is split over the token axes too, so
    a device stores 1/N of the dense weights, their gradients and their AdamW moments. The compiled
    step gathers a layer's weights where it uses them and reduce-scatters their gradients (XLA's
    partitioner inserts both). Per leaf:

    * routed experts: the expert axis over "expert" as above, and the largest other dimension that
      "data" divides over "data" (ZeRO for experts: the EP shard_map gathers that dimension back;
      the hero stores its expert width padded to a multiple of its 11 racks for this,
      MoEConfig.expert_width_multiple);
    * other matrices: the largest non-layer dimension that the whole mesh divides, over
      ("data", "expert"); failing that, the largest that "expert" divides, over "expert"; failing
      that, over "data". The hero's 11 x 64 mesh divides none of its dense dimensions (powers of two
      times 3), so its dense weights split 64 ways inside a rack and are replicated across the 11 racks:
      the gathers stay on the rack's NVLink and the per-device state is 64x smaller;
    * vectors (norm scales; 1-D per layer) and scalars stay replicated: d floats per layer, a
      collective per layer to gather them would cost more than it saves.

    A dimension is sharded only where it divides evenly: uneven shards would pad every collective and
    make the state's bytes per device differ between devices.

The rule is a pure function of (leaf role, shape, mesh shape, mode) so the memory planner
(marin.training.planning) applies the very rule marin.parallel.mesh uses to build the NamedShardings.
It reads a leaf's role (:mod:`marin.parallel.roles`: an ``expert_stack`` is split over the experts,
a ``vector`` never), never its name, so a leaf the model's parameter table adds is placed by its role.
"""

from __future__ import annotations

from marin.parallel.roles import EXPERT_STACK, VECTOR, check_role

DATA, EXPERT = "data", "expert"
PARAM_SHARDINGS = ("replicated", "fsdp")

# One entry per dimension: None (not split), a mesh axis name, or a tuple of axis names.
Partition = tuple[None | str | tuple[str, ...], ...]


def check_param_sharding(mode: str) -> str:
    if mode not in PARAM_SHARDINGS:
        raise ValueError(f"unknown param_sharding {mode!r}; choose from {PARAM_SHARDINGS}")
    return mode


def leaf_partition(role: str, shape: tuple[int, ...], mesh_shape: tuple[int, int], mode: str,
                   stacked: bool) -> Partition:
    """The partition of one parameter leaf (or of its AdamW moment, which has the same shape).

    ``role`` is the leaf's role (:mod:`marin.parallel.roles`: an ``expert_stack``'s axis 1 after the
    layer axis is the experts); ``stacked`` says whether axis 0 is the stacked-layer axis (leaves
    under ``params["blocks"]``), which is never split: the layer scan slices it."""
    check_param_sharding(mode)
    check_role(role, "leaf_partition")
    data, expert = mesh_shape
    ndim = len(shape)
    spec: list[None | str | tuple[str, ...]] = [None] * ndim
    first = 1 if stacked else 0
    if role == EXPERT_STACK and ndim >= 3:  # [layers, experts, ...]
        spec[1] = EXPERT
        if mode == "fsdp" and data > 1:
            dim = _largest_divisible(shape, range(2, ndim), data)
            if dim is not None:
                spec[dim] = DATA
        return tuple(spec)
    if mode == "replicated" or ndim - first < 2 or role == VECTOR:
        return tuple(spec)
    candidates = range(first, ndim)
    for axes, size in (((DATA, EXPERT), data * expert), (EXPERT, expert), (DATA, data)):
        if size <= 1:
            continue
        dim = _largest_divisible(shape, candidates, size)
        if dim is not None:
            spec[dim] = axes
            return tuple(spec)
    return tuple(spec)


def _largest_divisible(shape: tuple[int, ...], dims, size: int) -> int | None:
    """The dimension among ``dims`` with the most elements that ``size`` divides (earliest on ties)."""
    best = None
    for d in dims:
        if shape[d] % size == 0 and shape[d] >= size and (best is None or shape[d] > shape[best]):
            best = d
    return best


def shard_shape(shape: tuple[int, ...], partition: Partition, mesh_shape: tuple[int, int]) -> tuple[int, ...]:
    """The per-device block of a leaf of ``shape`` under ``partition``."""
    sizes = {DATA: mesh_shape[0], EXPERT: mesh_shape[1]}
    out = []
    for n, axes in zip(shape, partition):
        k = 1
        for a in (() if axes is None else (axes,) if isinstance(axes, str) else axes):
            k *= sizes[a]
        out.append(n // k)
    return tuple(out)
