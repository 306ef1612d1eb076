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
   (:mod:`marin.pools.stall`): a hung host never fails by itself.

The site inventory is data: the pools marin ships with (this machine's CPU pools, a lent H200, the
GB200 NVL72 racks) and the device memory of each accelerator are in ``pools.toml`` beside this module,
with their sources. Your own pools are a file of the same form, named by ``--pools FILE`` (``marin
plan``, ``marin run``) or ``MARIN_POOLS`` (:func:`load_pools_file`, :func:`use_pools_files`), or a
:class:`PoolSpec` declared in an experiment file and passed where a pool name is accepted
(``default_train(pool=...)``, ``default_eval(pool=...)``). :data:`POOLS` holds every pool known by
name in this process; :func:`get_pool` turns a name, a spec or a recorded spec into a spec.

This module imports Ray and JAX lazily: experiment files read the presets without either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import re
import socket
import sys
import time
import tomllib
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from marin.execution import storage
from marin.execution.cluster import (
    cluster_can_grow,
    ensure_ray,
    import_ray_for_the_driver,
    local_cluster_with_nodes,
    placement_owner,
)
from marin.execution.failures import (
    InfrastructureFailure,
    StopRequested,
    host_memory_error,
    is_infrastructure_failure,
)
from marin.pools.stall import (
    PoolStalled,
    ProgressWatch,
    StallRule,
    append_stall_record,
    start_reporting,
    stop_reporting,
)

logger = logging.getLogger(__name__)

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
    device_memory_bytes: int | None = None
    """Memory of one device, bytes; None: the accelerator's, from :data:`ACCELERATOR_MEMORY_BYTES`
    (set it for an accelerator marin does not list; a CPU pool shares this machine's memory)."""

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


SHIPPED_POOLS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pools.toml")
"""The pools and accelerators marin ships with, with their sources."""

POOLS_ENV = "MARIN_POOLS"
"""Pools files every marin process reads (``os.pathsep``-separated): ``marin run --pools FILE`` sets
it, so the processes a run starts (its Ray workers, the pool's hosts) know the same pools by name."""


class PoolsFileError(ValueError):
    """A pools file that cannot be read, is not TOML, or holds a bad field: one line naming the file
    and the field."""


def _spec(name: str, fields: Mapping[str, Any]) -> PoolSpec:
    """A PoolSpec from a pools file's table or a recorded spec (``mesh`` is a list in both)."""
    fields = dict(fields)
    if "mesh" in fields and isinstance(fields["mesh"], (list, tuple)):
        fields["mesh"] = tuple(fields["mesh"])
    return PoolSpec(**{**fields, "name": name})


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise PoolsFileError(f"pools file {path}: cannot read it: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise PoolsFileError(f"pools file {path}: not TOML: {e}") from None


def _shipped() -> tuple[dict[str, PoolSpec], dict[str, int]]:
    """The shipped inventory, read without draccus (the device machine's image has none; a test reads
    the same file through :func:`read_pools_file`'s checked path and compares)."""
    data = _read_toml(SHIPPED_POOLS_FILE)
    memory = {k: int(v["device_memory_mib"]) * (1 << 20) for k, v in data["accelerators"].items()}
    return {name: _spec(name, table) for name, table in data["pools"].items()}, memory


POOLS, ACCELERATOR_MEMORY_BYTES = _shipped()
"""Every pool known by name in this process (the shipped ones, then those of pools files), and the
memory of one device of each accelerator marin knows, bytes."""
SHIPPED_POOL_NAMES = tuple(POOLS)

# Node label that groups the nodes of one NVL72 rack (set per worker group in infra/); the shipped
# GB200 pools name it as their rack_label.
RACK_LABEL = POOLS["gb200-rack"].rack_label

POOL_FILE_SECTIONS = ("pools", "accelerators")


def read_pools_file(path: str) -> tuple[dict[str, PoolSpec], dict[str, int]]:
    """The pools (``[pools.NAME]``: PoolSpec's fields, checked by draccus) and accelerators
    (``[accelerators.NAME] device_memory_mib = ...``) of a pools file. Raises :class:`PoolsFileError`
    naming the file and the field."""
    import draccus  # draccus: only to read a user's pools file (the device machine's image has none)
    from draccus.utils import DecodingError, ParsingError  # (the same)

    data = _read_toml(path)
    where = f"pools file {path}"
    unknown = sorted(set(data) - set(POOL_FILE_SECTIONS))
    if unknown:
        raise PoolsFileError(f"{where}: unknown section [{unknown[0]}]; a pools file has "
                             + " and ".join(f"[{s}.NAME]" for s in POOL_FILE_SECTIONS) + " tables")
    memory: dict[str, int] = {}
    for name, table in (data.get("accelerators") or {}).items():
        mib = table.get("device_memory_mib") if isinstance(table, dict) else None
        if isinstance(mib, bool) or not isinstance(mib, int) or mib <= 0 or set(table) != {"device_memory_mib"}:
            raise PoolsFileError(f"{where}: accelerators.{name}: needs exactly device_memory_mib, a positive "
                                 f"integer (MiB of one device), got {table!r:.80}")
        memory[name] = mib * (1 << 20)
    pools: dict[str, PoolSpec] = {}
    for name, table in (data.get("pools") or {}).items():
        if not isinstance(table, dict):
            raise PoolsFileError(f"{where}: pools.{name}: a table of PoolSpec fields, got {table!r:.80}")
        if table.get("name", name) != name:
            raise PoolsFileError(f"{where}: pools.{name}.name: {table['name']!r} differs from the table's name")
        try:
            spec = draccus.decode(PoolSpec, {**table, "name": name})
        except DecodingError as e:
            field = "".join(f".{k}" for k in e.key_path)
            raise PoolsFileError(f"{where}: pools.{name}{field}: {e.message}") from None
        except ParsingError as e:  # PoolSpec's own checks ("pool NAME: ..."), raised inside draccus
            problem = str(e.__cause__) if isinstance(e.__cause__, ValueError) else str(e)
            raise PoolsFileError(f"{where}: pools.{name}: {problem.removeprefix(f'pool {name}: ')}") from None
        known = {**ACCELERATOR_MEMORY_BYTES, **memory}
        if not spec.is_cpu and spec.device_memory_bytes is None and spec.accelerator not in known:
            raise PoolsFileError(f"{where}: pools.{name}.device_memory_bytes: needed for accelerator "
                                 f"{spec.accelerator!r}, whose memory marin does not know (known: "
                                 f"{', '.join(sorted(known))}; or add [accelerators.{spec.accelerator}])")
        pools[name] = spec
    return pools, memory


def declare_pool(spec: PoolSpec) -> PoolSpec:
    """Make ``spec`` known by its name in this process (:data:`POOLS`). A name already known with other
    values is refused: one name, one pool. Other processes know it only through a pools file
    (``--pools``, ``MARIN_POOLS``); to a step, pass the spec itself."""
    known = POOLS.get(spec.name)
    if known is not None and known != spec:
        where = "marin's shipped pools" if spec.name in SHIPPED_POOL_NAMES else "an earlier declaration"
        raise ValueError(f"pool {spec.name!r} is already declared, with other values, by {where}; give yours "
                         "another name")
    POOLS[spec.name] = spec
    return spec


def load_pools_file(path: str) -> list[PoolSpec]:
    """Read a pools file (:func:`read_pools_file`) and declare its accelerators and pools here."""
    pools, memory = read_pools_file(path)
    for name, nbytes in memory.items():
        if ACCELERATOR_MEMORY_BYTES.get(name, nbytes) != nbytes:
            raise PoolsFileError(f"pools file {path}: accelerators.{name}: marin already knows it with "
                                 f"{ACCELERATOR_MEMORY_BYTES[name] >> 20} MiB")
    ACCELERATOR_MEMORY_BYTES.update(memory)
    specs = []
    for name, spec in pools.items():
        try:
            specs.append(declare_pool(spec))
        except ValueError as e:
            raise PoolsFileError(f"pools file {path}: pools.{name}: {e}") from None
    return specs


ENV_FILES_READ: list[str] = []
"""The pools files this process has declared (``MARIN_POOLS``' and ``--pools``'), each read once."""


def load_env_pools() -> None:
    """Declare the pools of the files ``MARIN_POOLS`` names (each file once per process)."""
    for path in (p for p in os.environ.get(POOLS_ENV, "").split(os.pathsep) if p):
        if path not in ENV_FILES_READ:
            load_pools_file(path)
            ENV_FILES_READ.append(path)


def use_pools_files(paths: Sequence[str]) -> list[PoolSpec]:
    """``--pools FILE``: declare each file's pools here and add it to ``MARIN_POOLS``, so the
    processes this one starts (a local Ray cluster's workers, a pool's hosts) know them too."""
    load_env_pools()
    specs: list[PoolSpec] = []
    for path in map(os.path.abspath, paths):
        specs += load_pools_file(path)
        ENV_FILES_READ.append(path)
        current = [p for p in os.environ.get(POOLS_ENV, "").split(os.pathsep) if p]
        os.environ[POOLS_ENV] = os.pathsep.join([*current, path] if path not in current else current)
    return specs


def get_pool(pool: str | PoolSpec | Mapping[str, Any]) -> PoolSpec:
    """The spec of ``pool``: a name (the shipped pools, then those of ``MARIN_POOLS``' files), a
    :class:`PoolSpec` (itself), or a spec as a run's record holds it (a dict of its fields)."""
    if isinstance(pool, PoolSpec):
        return pool
    if isinstance(pool, Mapping):
        return _spec(pool["name"], pool)
    if pool not in POOLS:
        load_env_pools()
    try:
        return POOLS[pool]
    except KeyError:
        raise KeyError(f"unknown pool {pool!r}; known: {sorted(POOLS)} (a pool of your own: a pools file named by "
                       f"--pools FILE or {POOLS_ENV}, or a PoolSpec passed itself)") from None


def pool_name(pool: str | PoolSpec | Mapping[str, Any]) -> str:
    """The name of a pool given as a name, a spec or a recorded spec (for messages and tables)."""
    if isinstance(pool, PoolSpec):
        return pool.name
    return str(pool["name"]) if isinstance(pool, Mapping) else str(pool)


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


class HostOutOfMemory(PoolLaunchError):
    """Ray's memory monitor killed a host because its node ran low on host memory. Not retried: the
    same program on the same nodes needs the same memory."""


class PoolLostError(PoolLaunchError, InfrastructureFailure):
    """Every allowed attempt of the pool ended in an infrastructure failure (a host died, a peer went
    away, the pool stalled): the executor retries the step by itself, from its last checkpoint."""


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


def failed_hosts_nodes(groups: list[Any], pool: PoolSpec, errors: Mapping[int, BaseException]) -> list[dict[str, str]]:
    """The nodes of the hosts that died in a failed attempt (their process or node went away: a
    Ray actor, worker or node error on the host's own result; a survivor whose collective failed
    because a peer went away is not counted), each with its node id, address and why. ``errors``:
    the ended hosts' errors by host index (:func:`host_errors`)."""
    import ray  # Ray: only when a pool is launched; planning reads pool specs without it
    from ray.util.placement_group import placement_group_table  # (the same)

    died = {"ActorDiedError", "ActorUnavailableError", "NodeDiedError", "WorkerCrashedError", "OwnerDiedError",
            "LocalRayletDiedError"}
    dead = {i: e for i, e in errors.items() if {c.__name__ for c in type(e).__mro__} & died}
    if not dead:
        return []
    addresses = {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes()}
    out = []
    for i, e in dead.items():
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


def host_errors(refs: list[Any], wait_s: float = 2.0) -> dict[int, BaseException]:
    """The errors of the hosts of a failed attempt that have ended, by host index, waiting up to
    ``wait_s`` for the rest: the first error seen may be a survivor's collective failing because its
    peer went away, which reads like the step's own error, while the peer's own error says what
    happened to it."""
    import ray  # Ray: only when a pool is launched; planning reads pool specs without it

    if not refs:
        return {}
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
    errors = {}
    for i, ref in enumerate(refs):
        if ref not in done:
            continue
        try:
            ray.get(ref)
        except Exception as e:  # noqa: BLE001 - classified by the caller
            errors[i] = e
    return errors


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
    ``stall``: watch the hosts' heartbeat (:mod:`marin.pools.stall`; ``fn`` reports its steps with
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
            ended = host_errors(refs)
            if (memory := next(filter(None, map(host_memory_error, [e, *ended.values()])), None)) is not None:
                raise HostOutOfMemory(
                    f"pool {pool.name}: Ray's memory monitor killed a host, its node low on memory ({memory}); "
                    "each host needs more memory than its node has left, so a retry would fail the same way: "
                    "give the pool nodes with more memory (or fewer hosts per node), or make the step "
                    "smaller") from None
            if not any(map(is_infrastructure_failure, [e, *ended.values()])):
                raise inner from None  # a bug or a config error: the same on every attempt, so not retried
            note.add_bad_nodes(failed_hosts_nodes(groups, pool, ended))
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
        if attempt < retries:  # backoff: a lost node may take a while to be replaced
            time.sleep(min(30.0, 1.0 * 2 ** attempt))
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
