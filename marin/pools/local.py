"""A pool on this machine: a one-host pool in this process, and a CPU pool's hosts simulated as Ray
nodes, for the command lines that sample and evaluate on several hosts."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from marin.execution.cluster import ensure_ray, import_ray_for_the_driver, local_cluster_with_nodes
from marin.pools.hostenv import HostContext, initialize_jax
from marin.pools.launcher import launch
from marin.pools.spec import PoolSpec

logger = logging.getLogger(__name__)

def run_local(pool: PoolSpec, fn: Callable[..., Any], args: Sequence[Any] = ()) -> Any:
    """Run a single-host pool in this process (no Ray): for tests and interactive use."""
    if pool.hosts != 1:
        raise ValueError(f"pool {pool.name} has {pool.hosts} hosts; run it with launch()")
    ctx = HostContext(0, 1, None, pool)
    initialize_jax(ctx)
    return fn(ctx, *args)


def simulated_nodes(pool: PoolSpec) -> list[dict[str, Any]]:
    """The Ray nodes that stand for ``pool``'s hosts on this one machine (one per host: its CPUs, its
    device resource, its rack's label), for :func:`marin.execution.cluster.local_cluster_with_nodes`;
    empty for a pool the plain local cluster already holds (one host, no device resource). Only a
    CPU pool can be simulated: a GPU pool's hosts are machines of a real cluster (``--address``)."""
    if not pool.is_cpu:
        raise ValueError(f"pool {pool.name} runs on {pool.hosts} {pool.accelerator} host(s), which this machine cannot "
                         "simulate: pass --address (or set RAY_ADDRESS) of the Ray cluster that has them")
    if pool.hosts == 1 and not pool.device_resource:
        return []
    resources = {pool.device_resource: float(pool.devices_per_host)} if pool.device_resource else {}
    return [{"num_cpus": max(1, int(round(pool.cpus_per_host))), "resources": resources,
             "labels": {pool.rack_label: f"rack-{host // pool.hosts_per_rack:02d}"} if pool.rack_label else {}}
            for host in range(pool.hosts)]


def simulated_pool_note(pool: PoolSpec) -> str:
    """The one line a command prints when it starts simulated nodes for ``pool``."""
    return (f"starting {pool.hosts} simulated host(s) of pool {pool.name} as Ray nodes on this machine "
            f"({pool.devices_per_host} fake CPU devices each; stopped at the end; --address joins a real cluster)")


@contextlib.contextmanager
def pool_cluster(pool: PoolSpec, address: str | None = None,
                 say: Callable[[str], None] | None = None) -> Iterator[bool]:
    """The Ray cluster a command line runs ``pool`` on, for the ``with`` block; yields whether the
    pool goes through :func:`launch` (several hosts) or runs in this process (one host, no Ray).

    A pool of several hosts joins ``address`` (or ``RAY_ADDRESS``, or the cluster this process is
    already in); without one, a CPU pool's hosts are simulated on this machine (nodes started for
    the block and stopped after it, said in one line through ``say``), and any other pool is refused
    in one line (its hosts are machines only a real cluster has). What the hosts print (Ray
    forwards it to this process) goes to stderr for the block, so a command's stdout holds only its
    result (``--json``)."""
    if pool.hosts == 1:
        yield False
        return
    ray = import_ray_for_the_driver()
    address = address or os.environ.get("RAY_ADDRESS")
    with contextlib.ExitStack() as stack:
        # first in, last out: lines forwarded while the cluster stops go to stderr too
        stack.enter_context(contextlib.redirect_stdout(sys.stderr))
        if not ray.is_initialized() and address:
            ensure_ray(address)
            stack.callback(ray.shutdown)  # leaves the cluster; it is not ours to stop
        elif not ray.is_initialized():
            nodes = simulated_nodes(pool)
            (say or logger.warning)(simulated_pool_note(pool))
            stack.enter_context(local_cluster_with_nodes(nodes))
        yield True


def run_on_pool(pool: PoolSpec, fn: Callable[..., Any], args: Sequence[Any] = (), *, address: str | None = None,
                say: Callable[[str], None] | None = None) -> Any:
    """Host 0's result of ``fn(ctx, *args)`` run once per host of ``pool``, from a command line: in
    this process on a one-host pool (:func:`run_local`), else through :func:`launch` on the cluster
    :func:`pool_cluster` provides. What sampling and evaluation on several hosts go through."""
    with pool_cluster(pool, address, say) as on_ray:
        return launch(pool, fn, args)[0] if on_ray else run_local(pool, fn, args)
