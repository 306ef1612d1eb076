"""A pool host's process: its environment (fake CPU devices, XLA flags) and joining the pool's JAX runtime."""

from __future__ import annotations

import dataclasses
import os
import re

from marin.pools.spec import PoolSpec


@dataclasses.dataclass(frozen=True)
class HostContext:
    """What the host function learns about its place in the pool."""

    process_id: int
    num_processes: int
    coordinator: str | None
    pool: PoolSpec



def host_env(pool: PoolSpec, xla_flags: str | None = None) -> dict[str, str]:
    """Environment of a host process; fake CPU devices must be requested before JAX is imported.

    A CPU pool's hosts get the pool's device count in ``XLA_FLAGS`` and keep every other XLA flag
    of ``xla_flags`` (default: this process's ``XLA_FLAGS``), so flags an operator set (an HLO dump,
    a compiler option) reach the simulated hosts as they reach a GPU pool's."""
    env = {"RAY_USAGE_STATS_ENABLED": "0"}
    if pool.is_cpu:
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = with_device_count(os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags,
                                             pool.devices_per_host)
    return env


DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def with_device_count(xla_flags: str, devices: int | None) -> str:
    """``xla_flags`` with its fake CPU device count (if any) replaced by ``devices`` (None: removed,
    for a process that starts hosts which get their pool's count)."""
    kept = re.sub(rf"(^|\s){DEVICE_COUNT_FLAG}=\S*", "", xla_flags).strip()  # the rest byte for byte
    return " ".join(x for x in (kept, f"{DEVICE_COUNT_FLAG}={devices}" if devices is not None else "") if x)


def initialize_jax(ctx: HostContext) -> None:
    """Join the pool's JAX processes into one runtime (no-op for one host) and check the device count."""
    join_runtime(ctx)
    check_devices(ctx)


def join_runtime(ctx: HostContext) -> None:
    """The start-up rendezvous (no-op for one host): register with the pool's coordinator within the
    pool's ``rendezvous_timeout_s``, then a first collective across every host, so a peer that
    registered and went away is found here, not inside the first training step. A host still
    missing when the registration times out ends the process that waits for it (XLA's coordination
    client aborts): the launcher tells that apart by which hosts reached and passed this point."""
    import jax  # JAX: on the pool's hosts only; planning reads pool specs without it

    if ctx.num_processes > 1:
        if ctx.pool.is_cpu:
            # Cross-process collectives on CPU go through gloo (MPI is not in the wheel).
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            # With a persistent compilation cache (JAX_COMPILATION_CACHE_DIR) only process 0 writes
            # entries, so after a relaunch it loads its programs while the others compile; the
            # first collective then waits past gloo's fixed 30 s rendezvous for them. Simulated
            # hosts share one machine's cores anyway: they compile, every one.
            jax.config.update("jax_enable_compilation_cache", False)
        jax.distributed.initialize(
            coordinator_address=ctx.coordinator,
            num_processes=ctx.num_processes,
            process_id=ctx.process_id,
            local_device_ids=None if ctx.pool.is_cpu else list(range(ctx.pool.devices_per_host)),
            initialization_timeout=max(1, round(ctx.pool.rendezvous_timeout_s)),
        )
        # JAX (the same); the collective compiles a one-element sum, once per host and launch
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("marin: every host of the pool joined")


def check_devices(ctx: HostContext) -> None:
    """The pool's devices are all visible to this process's JAX (fake CPU devices are set up front)."""
    import jax  # JAX: on the pool's hosts only; planning reads pool specs without it

    if jax.device_count() < ctx.pool.num_devices:
        raise RuntimeError(
            f"pool {ctx.pool.name} wants {ctx.pool.num_devices} devices, JAX sees {jax.device_count()} "
            f"({jax.devices()[0].platform}); set XLA_FLAGS for fake CPU devices before importing jax"
        )

