"""Device pools: what a step runs on, and the launcher that starts one JAX process per host of a pool.

A pool (:class:`PoolSpec`) is ``hosts`` x ``devices_per_host`` accelerators of one type, grouped into
racks, with the (data, expert) mesh laid over them; the pools marin ships with are data
(``pools.toml`` beside this package). The launcher reserves the hosts, starts one process per host,
joins them into one JAX runtime, watches them for stalls and relaunches a pool that lost a host.

This package imports Ray and JAX lazily: experiment files read the pools without either.
"""

from marin.pools.launcher import (
    ACCELERATOR_MEMORY_BYTES,
    DEVICE_COUNT_FLAG,
    PLACEMENT_FILE,
    POOLS,
    POOLS_ENV,
    RACK_LABEL,
    SHIPPED_POOL_NAMES,
    SHIPPED_POOLS_FILE,
    HostContext,
    HostOutOfMemory,
    NonRetryableError,
    PlacementNote,
    PoolInfeasibleError,
    PoolLaunchError,
    PoolLostError,
    PoolsFileError,
    PoolSpec,
    declare_pool,
    get_pool,
    host_env,
    initialize_jax,
    launch,
    load_pools_file,
    pool_cluster,
    pool_name,
    read_pools_file,
    run_local,
    run_on_pool,
    simulated_nodes,
    simulated_pool_note,
    use_pools_files,
    with_device_count,
)

__all__ = [
    "ACCELERATOR_MEMORY_BYTES", "DEVICE_COUNT_FLAG", "PLACEMENT_FILE", "POOLS", "POOLS_ENV", "RACK_LABEL",
    "SHIPPED_POOLS_FILE", "SHIPPED_POOL_NAMES", "HostContext", "HostOutOfMemory", "NonRetryableError",
    "PlacementNote", "PoolInfeasibleError", "PoolLaunchError", "PoolLostError", "PoolSpec", "PoolsFileError",
    "declare_pool", "get_pool", "host_env", "initialize_jax", "launch", "load_pools_file", "pool_cluster",
    "pool_name", "read_pools_file", "run_local", "run_on_pool", "simulated_nodes", "simulated_pool_note",
    "use_pools_files", "with_device_count",
]
