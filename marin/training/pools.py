"""Device pools and the Ray launcher that runs one JAX process per host of a pool.

A pool is what a training step asks for: ``hosts`` x ``devices_per_host`` accelerators of one type,
grouped into racks, and the (data, expert) mesh laid over them. In production a rack is a GB200 NVL72
(16 nodes x 4 GPUs, EP 64 inside the rack, data parallelism across racks). On this machine a "host"
is a Ray worker process that sees N fake CPU devices.

Launch protocol (``launch``):
1. reserve every host with Ray placement groups, one per rack: hosts of a rack on distinct nodes
   (STRICT_SPREAD) and, where the pool names a rack label, all in the same rack (STRICT_PACK on it);
2. start one actor per host; host 0 picks the ``jax.distributed`` coordinator address on its node;
3. run the host function everywhere; the first failure kills every host (a JAX peer left alone would
   hang in a collective) and releases the reservation; then retry up to ``max_retries`` times. The
   host function resumes from the latest checkpoint, so a retry loses at most one checkpoint interval.
   With a stall rule, a pool whose hosts stop completing steps counts as failed too
   (:mod:`marin.training.stall`): a hung host never fails by itself.

This module imports Ray and JAX lazily: experiment files read the presets without either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from marin.execution import storage
from marin.execution.cluster import (
    cluster_can_grow,
    ensure_ray,
    import_ray_for_the_driver,
    local_cluster_with_nodes,
    placement_owner,
)
from marin.execution.failures import InfrastructureFailure, StopRequested, is_infrastructure_failure
from marin.training.stall import (
    PoolStalled,
    ProgressWatch,
    StallRule,
    append_stall_record,
    start_reporting,
    stop_reporting,
)

logger = logging.getLogger(__name__)

# Node label that groups the nodes of one NVL72 rack (set per worker group in infra/).
RACK_LABEL = "marin.io/rack"


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    """The devices a training step runs on and how its mesh maps onto them.

    ``mesh`` is (data, expert); devices are ordered host by host, so the expert axis spans consecutive
    hosts. EP must stay inside a rack (NVLink domain): ``expert`` must divide the devices of one rack.
    ``device_resource`` is the Ray resource each host reserves ``devices_per_host`` of: "GPU" on GPU
    clusters, or a custom resource that marks the fake CPU hosts in tests (None: CPU only).
    """

    name: str
    hosts: int
    devices_per_host: int
    accelerator: str
    mesh: tuple[int, int]
    racks: int = 1
    cpus_per_host: float = 1.0
    device_resource: str | None = None
    rack_label: str | None = None
    max_retries: int = 0
    """Times the launcher relaunches the pool inside one attempt of the step after a host failure."""
    infra_retries: int = 0
    """Times the executor reruns a step on this pool by itself after an infrastructure failure the
    launcher did not absorb (its ``ExecutorStep.infra_retries``): GPU pools 2, since a lost host is a
    daily event at scale; the local CPU pools 0, so a test's fault is seen, not retried
    (``--infra_retries N`` overrides for every step)."""
    ready_timeout_s: float = 300.0
    """How long a placement no node of the cluster can hold (infeasible) is given for the cluster to
    grow (an autoscaler adding nodes) before the step fails; on the local cluster ``marin run`` starts,
    which cannot grow, it fails at once. A placement the cluster can hold but whose resources are
    held (by this run's other steps or anyone's) waits for them without a limit."""
    bad_node_limit: int = 0
    """How many nodes whose hosts failed in this step the launcher leaves out of the next placement
    (0: none; a relaunch may land on the same node); one more such node fails the step with their list."""
    host_memory_bytes: int | None = None
    """Host (CPU) memory of one host, bytes; None: this machine's (the CPU pools run here)."""

    def __post_init__(self) -> None:
        data, expert = self.mesh
        if self.hosts <= 0 or self.devices_per_host <= 0 or self.racks <= 0:
            raise ValueError(f"pool {self.name}: hosts, devices_per_host and racks must be positive")
        if data * expert != self.num_devices:
            raise ValueError(
                f"pool {self.name}: mesh {self.mesh} has {data * expert} devices, pool has "
                f"{self.hosts} x {self.devices_per_host} = {self.num_devices}"
            )
        if self.hosts % self.racks:
            raise ValueError(f"pool {self.name}: {self.hosts} hosts do not split into {self.racks} racks")
        if self.racks > 1 and self.devices_per_rack % expert:
            raise ValueError(
                f"pool {self.name}: expert axis {expert} does not divide the {self.devices_per_rack} "
                "devices of a rack; EP traffic must stay inside a rack"
            )

    @property
    def num_devices(self) -> int:
        return self.hosts * self.devices_per_host

    @property
    def hosts_per_rack(self) -> int:
        return self.hosts // self.racks

    @property
    def devices_per_rack(self) -> int:
        return self.hosts_per_rack * self.devices_per_host

    @property
    def is_cpu(self) -> bool:
        return self.accelerator == "cpu"

    def bundle(self) -> dict[str, float]:
        """Ray resources one host reserves."""
        b: dict[str, float] = {"CPU": float(self.cpus_per_host)} if self.cpus_per_host else {}
        if self.device_resource:
            b[self.device_resource] = float(self.devices_per_host)
        if not b:
            raise ValueError(f"pool {self.name}: a host must reserve at least one resource")
        return b


# GB200 NVL72: 18 compute trays x 4 GPUs; the hero uses 16 nodes x 4 GPUs per rack (EP 64).
GB200_HOSTS_PER_RACK = 16
GB200_GPUS_PER_HOST = 4
# Host memory of one GB200 compute tray: two Grace CPUs with 480 GB LPDDR5X each (NVIDIA GB200 NVL72
# specifications). The lent H200 machine has 128 GiB.
GB200_HOST_MEMORY_BYTES = 960 * 10**9
H200_LENT_HOST_MEMORY_BYTES = 128 * (1 << 30)

POOLS: dict[str, PoolSpec] = {
    # One process, 8 fake CPU devices: EP 4 x data 2. The default for local runs and the quickstart.
    "local-cpu": PoolSpec("local-cpu", hosts=1, devices_per_host=8, accelerator="cpu", mesh=(2, 4)),
    # One process, one device: the reference for equivalence tests and the CPU benchmark.
    "local-cpu-1": PoolSpec("local-cpu-1", hosts=1, devices_per_host=1, accelerator="cpu", mesh=(1, 1)),
    # One process, 8 fake devices, EP 8: the single-process twin of "local-2host" (same mesh).
    "local-cpu-ep8": PoolSpec("local-cpu-ep8", hosts=1, devices_per_host=8, accelerator="cpu", mesh=(1, 8)),
    # Two simulated hosts x 4 fake devices, EP 8 across the process boundary (tests use Ray's
    # cluster utilities to give each simulated node one "fake_host" resource per device).
    "local-2host": PoolSpec(
        "local-2host", hosts=2, devices_per_host=4, accelerator="cpu", mesh=(1, 8), device_resource="fake_host"
    ),
    # One H200 (the lent device machine): the GPU benchmark.
    "h200-1": PoolSpec("h200-1", hosts=1, devices_per_host=1, accelerator="H200", mesh=(1, 1), device_resource="GPU",
                       infra_retries=2, host_memory_bytes=H200_LENT_HOST_MEMORY_BYTES),
    # One GB200 NVL72 rack: the d768 ladder rung (published: 1 rack, batch 1,024).
    "gb200-rack": PoolSpec(
        "gb200-rack",
        hosts=GB200_HOSTS_PER_RACK,
        devices_per_host=GB200_GPUS_PER_HOST,
        accelerator="GB200",
        mesh=(1, 64),
        racks=1,
        cpus_per_host=8,
        device_resource="GPU",
        rack_label=RACK_LABEL,
        max_retries=3,
        infra_retries=2,
        bad_node_limit=2,
        host_memory_bytes=GB200_HOST_MEMORY_BYTES,
    ),
    # Eleven racks, ~704 GPUs: the d2048 rung and the hero (EP 64 x DP 11).
    "gb200-11racks": PoolSpec(
        "gb200-11racks",
        hosts=11 * GB200_HOSTS_PER_RACK,
        devices_per_host=GB200_GPUS_PER_HOST,
        accelerator="GB200",
        mesh=(11, 64),
        racks=11,
        cpus_per_host=8,
        device_resource="GPU",
        rack_label=RACK_LABEL,
        max_retries=3,
        infra_retries=2,
        bad_node_limit=2 * 11,
        host_memory_bytes=GB200_HOST_MEMORY_BYTES,
    ),
}


def get_pool(name: str) -> PoolSpec:
    try:
        return POOLS[name]
    except KeyError:
        raise KeyError(f"unknown pool {name!r}; known: {sorted(POOLS)}") from None


@dataclasses.dataclass(frozen=True)
class HostContext:
    """What the host function learns about its place in the pool."""

    process_id: int
    num_processes: int
    coordinator: str | None
    pool: PoolSpec


class NonRetryableError(RuntimeError):
    """A failure a retry cannot fix (e.g. divergence): the launcher stops at once and re-raises it."""


class PoolLaunchError(RuntimeError):
    """The pool failed on every allowed attempt."""


class PoolLostError(PoolLaunchError, InfrastructureFailure):
    """Every allowed attempt of the pool ended in an infrastructure failure (a host died, a peer went
    away, the pool stalled): the executor retries the step by itself, from its last checkpoint."""


def host_env(pool: PoolSpec) -> dict[str, str]:
    """Environment of a host process; fake CPU devices must be requested before JAX is imported."""
    env = {"RAY_USAGE_STATS_ENABLED": "0"}
    if pool.is_cpu:
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={pool.devices_per_host}"
    return env


def initialize_jax(ctx: HostContext) -> None:
    """Join the pool's JAX processes into one runtime (no-op for one host) and check the device count."""
    import jax  # JAX: on the pool's hosts only; planning reads pool specs without it

    if ctx.num_processes > 1:
        if ctx.pool.is_cpu:
            # Cross-process collectives on CPU go through gloo (MPI is not in the wheel).
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=ctx.coordinator,
            num_processes=ctx.num_processes,
            process_id=ctx.process_id,
            local_device_ids=None if ctx.pool.is_cpu else list(range(ctx.pool.devices_per_host)),
        )
    if jax.device_count() < ctx.pool.num_devices:
        raise RuntimeError(
            f"pool {ctx.pool.name} wants {ctx.pool.num_devices} devices, JAX sees {jax.device_count()} "
            f"({jax.devices()[0].platform}); set XLA_FLAGS for fake CPU devices before importing jax"
        )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class _Host:
    """One pool host: a dedicated Ray worker process (Ray actor) that runs the JAX program."""

    def coordinator_address(self) -> str:
        import ray  # Ray: only when a pool is launched; planning reads pool specs without it

        return f"{ray.util.get_node_ip_address()}:{_free_port()}"

    def pid(self) -> int:
        return os.getpid()

    def run(self, fn: Callable[..., Any], ctx: HostContext, args: tuple[Any, ...],
            heartbeat: tuple[Any, StallRule] | None = None) -> Any:
        if heartbeat is not None:  # the launcher's stall watchdog: report progress to its board
            import ray  # Ray: only when a pool is launched; planning reads pool specs without it

            start_reporting(heartbeat[0], ctx.process_id, heartbeat[1], node=ray.util.get_node_ip_address())
        try:
            initialize_jax(ctx)
            return fn(ctx, *args)
        finally:
            stop_reporting()


def _placement_groups(pool: PoolSpec, owner: str = "", avoid: Sequence[str] = ()) -> list[Any]:
    """One placement group per rack, named ``owner`` first (see :func:`placement_owner`); ``avoid``:
    Ray node ids no bundle may land on (nodes whose hosts failed in this step)."""
    # Ray: only when a pool is launched; planning reads pool specs without it
    from ray.util.placement_group import placement_group

    groups = []
    # Unique per launch: two steps training on the same pool at once (ladder rungs) each get their own.
    launch_id = uuid.uuid4().hex[:8]
    selector = [{"ray.io/node-id": f"!in({','.join(avoid)})"}] * pool.hosts_per_rack if avoid else None
    for rack in range(pool.racks):
        bundles = [pool.bundle() for _ in range(pool.hosts_per_rack)]
        name = f"{owner}{pool.name}-rack{rack}-{launch_id}"
        if pool.rack_label:
            strategy = {"ray.io/node-id": "STRICT_SPREAD" if pool.hosts_per_rack > 1 else "PACK",
                        pool.rack_label: "STRICT_PACK"}
            groups.append(placement_group(bundles, topology_strategy=strategy, name=name,
                                          bundle_label_selector=selector))
        else:
            strategy_name = "STRICT_SPREAD" if pool.hosts_per_rack > 1 else "PACK"
            groups.append(placement_group(bundles, strategy=strategy_name, name=name, bundle_label_selector=selector))
    return groups


# ----------------------------------------------------------------------------------------------- #
# placement: queueing for a busy cluster, leaving out bad nodes                                    #
# ----------------------------------------------------------------------------------------------- #

PLACEMENT_FILE = ".pool_placement.json"
"""In the step directory: what the step's pool waits for and who holds it, and the nodes left out
because a host of this step failed on them (``marin status`` and ``marin show`` read it)."""

PLACEMENT_POLL_S = 1.0
WAIT_NOTE_AFTER_S = 2.0
"""A reservation not ready after this long is written down as waiting (most are ready at once)."""
WAIT_NOTE_EVERY_S = 15.0
PARTIAL_HOLD_S = 30.0
"""A pool of several racks that holds some of them and waits for the rest gives back what it holds
after this long and tries again later: two pools each holding half of what both need would
otherwise wait for each other forever."""


class PoolInfeasibleError(PoolLaunchError):
    """No node of the cluster can ever hold the pool's placement (it asks for more than any node, or
    more nodes than there are): a step error, not retried."""


def bundle_words(bundle: dict[str, float]) -> str:
    """``{"CPU": 1}`` -> "CPU"; ``{"CPU": 8, "GPU": 4}`` -> "(8 CPU + 4 GPU)": what one host reserves."""
    if len(bundle) == 1 and list(bundle.values()) == [1.0]:
        return next(iter(bundle))
    words = " + ".join(f"{v:g} {k}" for k, v in bundle.items())
    return words if len(bundle) == 1 else f"({words})"


def held_by(bundle: dict[str, float]) -> list[str]:
    """Who holds the resources ``bundle`` needs, right now: each placement group that reserved some
    (named by its step, see :func:`placement_owner`), and what tasks and actors outside any
    placement group use."""
    import ray  # Ray: only when a pool is launched; planning reads pool specs without it
    from ray.util.placement_group import placement_group_table  # (the same)

    reserved: dict[str, float] = {k: 0.0 for k in bundle}
    out = []
    for info in placement_group_table().values():
        if info["state"] != "CREATED":
            continue
        mine = {k: sum(b.get(k, 0.0) for b in info["bundles"].values()) for k in bundle}
        if any(mine.values()):
            for k, v in mine.items():
                reserved[k] += v
            out.append(f"{info['name'] or info['placement_group_id']} "
                       f"({', '.join(f'{v:g} {k}' for k, v in mine.items() if v)})")
    total, free = ray.cluster_resources(), ray.available_resources()
    outside = {k: total.get(k, 0.0) - free.get(k, 0.0) - reserved[k] for k in bundle}
    if any(v > 1e-9 for v in outside.values()):
        out.append(f"tasks and actors outside placement groups "
                   f"({', '.join(f'{v:g} {k}' for k, v in outside.items() if v > 1e-9)})")
    return out


class PlacementNote:
    """The step directory's :data:`PLACEMENT_FILE`, kept by the launcher (nothing without a step)."""

    def __init__(self, step_dir: str | None) -> None:
        self.path = f"{step_dir.rstrip('/')}/{PLACEMENT_FILE}" if step_dir else None
        self.state: dict[str, Any] = (storage.read_json(self.path) or {}) if self.path else {}
        self.state.setdefault("bad_nodes", [])
        self.state["waiting"] = None
        self._written = 0.0

    @property
    def bad_nodes(self) -> list[dict[str, str]]:
        return self.state["bad_nodes"]

    def _write(self) -> None:
        if self.path is None:
            return
        try:
            storage.write_text(self.path, json.dumps({**self.state, "updated": time.time()}, indent=1))
        except Exception as e:  # noqa: BLE001 - a note for people; the launch goes on without it
            logger.warning("could not write %s: %s", self.path, e)
        self._written = time.monotonic()

    def waiting(self, want: str, holders: list[str], since: float) -> None:
        """The reservation waits for ``want`` (e.g. "1 x CPU"), held by ``holders``."""
        previous = self.state["waiting"]
        changed = previous is not None and previous["held_by"] != holders
        if previous is None or (changed and time.monotonic() - self._written > WAIT_NOTE_EVERY_S):
            self.state["waiting"] = {"for": want, "held_by": holders, "since": since}
            self._write()

    def placed(self) -> None:
        """The reservation is ready: a wait that was written down is kept as the last one, with its length."""
        waiting = self.state["waiting"]
        if waiting is not None:
            self.state["waited"] = {**waiting, "s": round(time.time() - waiting["since"], 1)}
            self.state["waiting"] = None
            self._write()

    def add_bad_nodes(self, nodes: list[dict[str, str]]) -> None:
        known = {n["node_id"] for n in self.bad_nodes}
        new = [n for n in nodes if n["node_id"] not in known]
        if new:
            self.bad_nodes.extend(new)
            self._write()


def wait_for_placement(pool: PoolSpec, groups: list[Any], make_groups: Callable[[], list[Any]],
                       note: PlacementNote) -> None:
    """Wait until every placement group in ``groups`` is ready, for as long as the cluster can hold
    them; write the wait down (:class:`PlacementNote`) once it lasts.

    A group Ray reports INFEASIBLE (no node, as the cluster is, could ever hold it) fails the launch
    with :class:`PoolInfeasibleError`: at once on a cluster that cannot grow, else after
    ``pool.ready_timeout_s`` without a node that could. A pool of several racks that holds some and
    waits for the rest past :data:`PARTIAL_HOLD_S` gives its groups back and asks again later
    (``groups`` is updated in place, so the caller removes what is current)."""
    import ray  # Ray: only when a pool is launched; planning reads pool specs without it
    from ray.util.placement_group import placement_group_table, remove_placement_group  # (the same)

    began = time.monotonic()
    wall_began = time.time()
    infeasible_since: float | None = None
    partial_since: float | None = None
    refs = [g.ready() for g in groups]
    while True:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PLACEMENT_POLL_S)
        if len(ready) == len(refs):
            note.placed()
            return
        now = time.monotonic()
        pending = [g for g, r in zip(groups, refs) if r not in ready]
        states = [placement_group_table(g)["stats"]["scheduling_state"] for g in pending]
        if "INFEASIBLE" in states:
            infeasible_since = infeasible_since or now
            if not cluster_can_grow() or now - infeasible_since >= pool.ready_timeout_s:
                raise PoolInfeasibleError(infeasible_message(pool, note.bad_nodes, grow=cluster_can_grow()))
        else:
            infeasible_since = None
        if ready and len(groups) > 1:
            partial_since = partial_since or now
            if now - partial_since >= PARTIAL_HOLD_S:
                for g in groups:
                    remove_placement_group(g)
                time.sleep(random.uniform(1.0, PARTIAL_HOLD_S / 3))
                groups[:] = make_groups()
                refs = [g.ready() for g in groups]
                partial_since = None
                continue
        else:
            partial_since = None
        if now - began >= WAIT_NOTE_AFTER_S and infeasible_since is None:
            note.waiting(f"{pool.hosts} x {bundle_words(pool.bundle())}", held_by(pool.bundle()), wall_began)


def infeasible_message(pool: PoolSpec, bad_nodes: list[dict[str, str]], *, grow: bool) -> str:
    """One line: the pool's placement no node can hold, what the cluster's nodes offer, and the nodes
    left out because a host of this step failed there."""
    import ray  # Ray: only when a pool is launched; planning reads pool specs without it

    alive = [n for n in ray.nodes() if n.get("Alive")]
    keys = list(pool.bundle())
    offers = sorted(", ".join(f"{n['Resources'].get(k, 0):g} {k}" for k in keys) for n in alive)
    spread = f" on {pool.hosts_per_rack} distinct nodes" + (" of one rack" if pool.rack_label else "") \
        if pool.hosts_per_rack > 1 else ""
    when = f"within {pool.ready_timeout_s:.0f} s" if grow else "(this local cluster cannot grow)"
    nodes = ", ".join(describe_node(n) for n in bad_nodes)
    left_out = f"; left out because a host of this step failed there: {nodes}" if bad_nodes else ""
    return (f"pool {pool.name}: no node of the Ray cluster can hold {pool.hosts} x {bundle_words(pool.bundle())}"
            f"{spread} {when}; its {len(alive)} node(s) offer: {'; '.join(offers) or 'nothing'}{left_out}")


def describe_node(node: dict[str, str]) -> str:
    return f"{node['node_id'][:12]} ({node.get('ip', '?')}: {node.get('why', 'host failed')})"


def failed_hosts_nodes(groups: list[Any], pool: PoolSpec, refs: list[Any], wait_s: float = 2.0) -> list[dict[str, str]]:
    """The nodes of the hosts that died in a failed attempt (their process or node went away: a
    Ray actor, worker or node error on the host's own result; a survivor whose collective failed
    because a peer went away is not counted), each with its node id, address and why."""
    import ray  # Ray: only when a pool is launched; planning reads pool specs without it
    from ray.util.placement_group import placement_group_table  # (the same)

    if not refs:
        return []
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
    died = {"ActorDiedError", "ActorUnavailableError", "NodeDiedError", "WorkerCrashedError", "OwnerDiedError",
            "LocalRayletDiedError"}
    addresses = {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes()}
    out = []
    for i, ref in enumerate(refs):
        if ref not in done:
            continue
        try:
            ray.get(ref)
        except Exception as e:  # noqa: BLE001 - classified below
            if not {c.__name__ for c in type(e).__mro__} & died:
                continue
            node = placement_group_table(groups[i // pool.hosts_per_rack])["bundles_to_node_id"].get(
                i % pool.hosts_per_rack)
            if node:
                out.append({"node_id": node, "ip": addresses.get(node, "?"), "host": str(i),
                            "why": f"host {i}: {type(e).__name__}"})
    return out


def nodes_to_avoid(pool: PoolSpec, note: PlacementNote) -> list[str]:
    """Node ids the next placement leaves out: nodes of this step's failed hosts that are still in
    the cluster (a node that left needs no avoiding). Raises :class:`PoolLaunchError` with their list
    when there are more than ``pool.bad_node_limit``; none when the limit is 0."""
    import ray  # Ray: only when a pool is launched; planning reads pool specs without it

    if pool.bad_node_limit <= 0 or not note.bad_nodes:
        return []
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    bad = [n for n in note.bad_nodes if n["node_id"] in alive]
    if len(bad) > pool.bad_node_limit:
        raise PoolLaunchError(f"pool {pool.name}: hosts of this step failed on {len(bad)} nodes, more than its "
                              f"bad_node_limit {pool.bad_node_limit}: {', '.join(describe_node(n) for n in bad)}")
    return [n["node_id"] for n in bad]


def _a_host_was_lost(refs: list[Any], wait_s: float = 2.0) -> bool:
    """Whether any host of a failed attempt died underneath (the first error seen may be a survivor's
    collective failing because its peer went away, which reads like the step's own error)."""
    import ray  # Ray: only when a pool is launched; planning reads pool specs without it

    if not refs:
        return False
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
    for ref in done:
        try:
            ray.get(ref)
        except Exception as e:  # noqa: BLE001 - classified below
            if is_infrastructure_failure(e):
                return True
    return False


def _unwrap(error: BaseException) -> BaseException:
    """The user exception inside a Ray task/actor error, if there is one."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error


def _one_line(error: BaseException) -> str:
    """``Type: message`` on one line: the last non-empty line of the message that is not a traceback
    frame (Ray's task errors put the remote traceback first and the cause last)."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    cause = next((ln for ln in reversed(lines) if not ln.startswith(("File ", "Traceback", "^", "~"))), "")
    name = type(error).__name__
    return (cause if cause.startswith(f"{name}:") else f"{name}: {cause}" if cause else name)[:400]


def _wait_for_hosts(refs: list[Any], watch: ProgressWatch | None, pool: PoolSpec, attempt: int,
                    stall_log: str | None) -> None:
    """Wait until every host returned; the first failure raises. With ``watch``, a pool in which no
    host completes a step within the rule's allowance is recorded (which hosts were behind) and raised
    as :class:`PoolStalled`, which the launcher retries like a lost host."""
    import ray  # Ray: only when a pool is launched; planning reads pool specs without it

    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=None if watch is None else watch.rule.beat_every_s)
        ray.get(done)  # the first failure raises here; the caller's finally clause tears all down
        if watch is None or not pending:
            continue
        stall = watch.check()
        if stall is not None:
            message = stall.message(pool.name)
            logger.warning("%s; killing the pool and relaunching it from the last checkpoint", message)
            if stall_log:
                append_stall_record(stall_log, stall.record(pool.name, attempt))
            raise PoolStalled(message)


def launch(
    pool: PoolSpec, fn: Callable[..., Any], args: Sequence[Any] = (), *, max_retries: int | None = None,
    stall: StallRule | None = None, stall_log: str | None = None,
    step_dir: str | None = None,
) -> list[Any]:
    """Run ``fn(ctx, *args)`` once per host of ``pool``; returns the per-host results in host order.

    Needs an initialised Ray (the executor's step task has one). Raises the host's exception for
    ``NonRetryableError``, else ``PoolLaunchError`` after ``max_retries`` (default: the pool's) retries.
    ``stall``: watch the hosts' heartbeat (:mod:`marin.training.stall`; ``fn`` reports its steps with
    ``report_step``) and relaunch a pool that stops completing steps, recording each stall in the JSON
    list at ``stall_log``.
    ``step_dir``: the step's directory, where the launcher notes what its reservation waits for and
    which nodes it leaves out (:class:`PlacementNote`); its placement groups are named after it.
    """
    import ray  # Ray: only when a pool is launched; planning reads pool specs without it
    from ray.util.placement_group import remove_placement_group  # (the same)
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # (the same)

    retries = pool.max_retries if max_retries is None else max_retries
    host_cls = ray.remote(_Host)
    errors: list[str] = []
    last_cause = ""
    note, owner = PlacementNote(step_dir), placement_owner(step_dir)
    for attempt in range(retries + 1):
        avoid = nodes_to_avoid(pool, note)
        groups = _placement_groups(pool, owner, avoid)
        actors: list[Any] = []
        refs: list[Any] = []  # the hosts' results, once started
        watch: ProgressWatch | None = None
        try:
            wait_for_placement(pool, groups, lambda avoid=avoid: _placement_groups(pool, owner, avoid), note)
            for i in range(pool.hosts):
                group = groups[i // pool.hosts_per_rack]
                resources = {k: v for k, v in pool.bundle().items() if k not in ("CPU", "GPU")}
                actors.append(
                    host_cls.options(
                        num_cpus=pool.cpus_per_host,
                        num_gpus=pool.devices_per_host if pool.device_resource == "GPU" else 0,
                        resources=resources,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=group, placement_group_bundle_index=i % pool.hosts_per_rack
                        ),
                        runtime_env={"env_vars": host_env(pool)},
                        max_restarts=0,
                        name=None,
                    ).remote()
                )
            coordinator = ray.get(actors[0].coordinator_address.remote()) if pool.hosts > 1 else None
            watch = ProgressWatch(stall, pool.hosts) if stall is not None else None
            heartbeat = (watch.board, stall) if watch is not None else None
            refs = [
                a.run.remote(fn, HostContext(i, pool.hosts, coordinator, pool), tuple(args), heartbeat)
                for i, a in enumerate(actors)
            ]
            _wait_for_hosts(refs, watch, pool, attempt + 1, stall_log)
            return ray.get(refs)
        except Exception as e:  # noqa: BLE001 - every host failure is handled the same way
            inner = _unwrap(e)
            if isinstance(inner, (NonRetryableError, StopRequested)):  # the latter: the run is ending
                raise inner from None
            if not (is_infrastructure_failure(e) or _a_host_was_lost(refs)):
                raise inner from None  # a bug or a config error: the same on every attempt, so not retried
            note.add_bad_nodes(failed_hosts_nodes(groups, pool, refs))
            errors.append(f"attempt {attempt + 1}: {type(inner).__name__}: {inner}")
            last_cause = _one_line(inner)
            logger.warning("pool %s failed (attempt %d/%d): %s", pool.name, attempt + 1, retries + 1, inner)
        finally:
            for a in actors:
                ray.kill(a, no_restart=True)
            for g in groups:
                remove_placement_group(g)
            if watch is not None:
                watch.close()
        time.sleep(min(30.0, 1.0 * 2 ** attempt))  # backoff: a lost node may take a while to be replaced
    # The first line is what a step's recorded failure reason shows: it must carry the cause itself.
    raise PoolLostError(f"pool {pool.name} failed after {retries + 1} attempt(s); last: {last_cause}\n"
                          + "\n".join(errors))


def run_local(pool: PoolSpec, fn: Callable[..., Any], args: Sequence[Any] = ()) -> Any:
    """Run a single-host pool in this process (no Ray): for tests and interactive use."""
    if pool.hosts != 1:
        raise ValueError(f"pool {pool.name} has {pool.hosts} hosts; run it with launch()")
    ctx = HostContext(0, 1, None, pool)
    initialize_jax(ctx)
    return fn(ctx, *args)


# ----------------------------------------------------------------------------------------------- #
# the command line's pools: sampling and evaluation on several hosts, simulated nodes             #
# ----------------------------------------------------------------------------------------------- #

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
