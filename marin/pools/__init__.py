"""Device pools: what a step runs on, and the launcher that starts one JAX process per host of a pool.

One module per concept:

* :mod:`~marin.pools.spec`: :class:`PoolSpec` and the pools known by name (``pools.toml`` beside
  this package, and a user's pools files);
* :mod:`~marin.pools.hostenv`: a host process's environment (fake CPU devices, XLA flags) and joining
  the pool's JAX runtime;
* :mod:`~marin.pools.placement`: reserving the hosts on the Ray cluster, queueing for a busy cluster,
  leaving out bad nodes;
* :mod:`~marin.pools.launcher`: :func:`launch` and the :class:`Launcher` seam (marin's is Ray's);
* :mod:`~marin.pools.stall`: the stall watchdog the launcher runs;
* :mod:`~marin.pools.local`: a pool on this machine (one host in this process, simulated hosts);
* :mod:`~marin.pools.errors`: how a launch fails.

This package imports Ray and JAX lazily: experiment files read the pools without either.
"""

from marin.pools.errors import (
    HostOutOfMemory,
    NonRetryableError,
    PoolInfeasibleError,
    PoolLaunchError,
    PoolLostError,
    RendezvousError,
)
from marin.pools.hostenv import DEVICE_COUNT_FLAG, HostContext, host_env, initialize_jax, with_device_count
from marin.pools.launcher import LAUNCHERS, Launcher, RayLauncher, launch, register_launcher
from marin.pools.local import pool_cluster, run_local, run_on_pool, simulated_nodes, simulated_pool_note
from marin.pools.placement import PLACEMENT_FILE, PlacementNote
from marin.pools.spec import (
    ACCELERATOR_MEMORY_BYTES,
    POOLS,
    POOLS_ENV,
    RACK_LABEL,
    SHIPPED_POOL_NAMES,
    SHIPPED_POOLS_FILE,
    PoolsFileError,
    PoolSpec,
    as_pool,
    declare_pool,
    get_pool,
    load_pools_file,
    read_pools_file,
    use_pools_files,
)

__all__ = [
    "ACCELERATOR_MEMORY_BYTES", "DEVICE_COUNT_FLAG", "LAUNCHERS", "PLACEMENT_FILE", "POOLS", "POOLS_ENV",
    "RACK_LABEL", "SHIPPED_POOLS_FILE", "SHIPPED_POOL_NAMES", "HostContext", "HostOutOfMemory", "Launcher",
    "NonRetryableError", "PlacementNote", "PoolInfeasibleError", "PoolLaunchError", "PoolLostError", "PoolSpec",
    "PoolsFileError", "RayLauncher", "RendezvousError", "as_pool", "declare_pool", "get_pool", "host_env",
    "initialize_jax", "launch", "load_pools_file", "pool_cluster", "read_pools_file", "register_launcher", "run_local",
    "run_on_pool", "simulated_nodes", "simulated_pool_note", "use_pools_files", "with_device_count",
]
