"""What a pool is, and the pools known by name: the shipped inventory (``pools.toml``) and a user's.

A pool is what a step asks for: ``hosts`` x ``devices_per_host`` accelerators of one type, grouped
into racks, and the (data, expert) mesh laid over them. In production a rack is a GB200 NVL72 (16
nodes x 4 GPUs, EP 64 inside the rack, data parallelism across racks). On this machine a "host" is a
process that sees N fake CPU devices.

The site inventory is data: the pools marin ships with (this machine's CPU pools, a lent H200, the
GB200 NVL72 racks) and the device memory of each accelerator are in ``pools.toml`` beside this module,
with their sources. Your own pools are a file of the same form, named by ``--pools FILE`` (``marin
plan``, ``marin run``) or ``MARIN_POOLS`` (:func:`load_pools_file`, :func:`use_pools_files`), or a
:class:`PoolSpec` declared in an experiment file and passed where a pool name is accepted
(``default_train(pool=...)``, ``default_eval(pool=...)``). :data:`POOLS` holds every pool known by
name in this process; :func:`get_pool` turns a name into its spec.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tomllib
from collections.abc import Mapping, Sequence
from typing import Any

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
    rendezvous_timeout_s: float = 300.0
    """How long the hosts wait for each other at start-up (registering with the pool's coordinator,
    ``jax.distributed``'s initialization timeout): a host missing past it fails the attempt."""
    rendezvous_retries: int = 5
    """Times the launcher relaunches a pool whose hosts did not all join the start-up rendezvous (a
    registration timeout, a host that ended before joining, a peer missing at the first collective),
    a budget of its own beside ``max_retries``: at scale, registration is what fails most at start
    (a run of 704 GPUs recovered on its 12th attempt); waits ``rendezvous_backoff_s``, doubling."""
    rendezvous_backoff_s: float = 5.0
    """The wait before the first relaunch after a failed rendezvous; it doubles each time, up to 5 minutes."""
    launcher: str = "ray"
    """The kind of launcher that starts the pool's hosts (:data:`marin.pools.launcher.LAUNCHERS`):
    "ray", placement groups and one Ray actor per host; another kind is added with
    :func:`marin.pools.launcher.register_launcher`, and named ``"module:kind"`` (the module that
    registers it when imported), so that the process that launches the pool, a Ray worker, imports
    it there (:func:`marin.pools.launcher.launcher_of`)."""

    def __post_init__(self) -> None:
        data, expert = self.mesh
        if self.hosts <= 0 or self.devices_per_host <= 0 or self.racks <= 0:
            raise ValueError(f"pool {self.name}: hosts, devices_per_host and racks must be positive")
        if self.rendezvous_timeout_s <= 0 or self.rendezvous_retries < 0 or self.rendezvous_backoff_s < 0:
            raise ValueError(f"pool {self.name}: rendezvous_timeout_s must be positive, rendezvous_retries and "
                             "rendezvous_backoff_s at least 0")
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
SHIPPED: dict[str, PoolSpec] = dict(POOLS)
"""The pools marin ships with, by name, as shipped (a declared spec of the same name must equal its)."""

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
        where = "marin's shipped pools" if spec.name in SHIPPED else "an earlier declaration"
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
    """``--pools FILE``: declare each file's pools in this process (after ``MARIN_POOLS``' files).
    A step's config carries the :class:`PoolSpec` it was built with, so the processes this one
    starts (Ray workers, a pool's hosts) need no pools file."""
    load_env_pools()
    specs: list[PoolSpec] = []
    for path in map(os.path.abspath, paths):
        if path not in ENV_FILES_READ:
            specs += load_pools_file(path)
            ENV_FILES_READ.append(path)
    return specs


def get_pool(name: str) -> PoolSpec:
    """The pool known by ``name``: a shipped one, then those of pools files (``--pools``, and
    ``MARIN_POOLS``' files, read on the first name not known yet). KeyError, one line, for a name
    no one declared."""
    if not isinstance(name, str):
        raise TypeError(f"a pool name is a string, got {type(name).__name__}; a PoolSpec is used as it is")
    if name not in POOLS:
        load_env_pools()
    try:
        return POOLS[name]
    except KeyError:
        raise KeyError(f"unknown pool {name!r}; known: {sorted(POOLS)} (a pool of your own: a pools file named by "
                       f"--pools FILE or {POOLS_ENV}, or a PoolSpec passed itself)") from None


def as_pool(pool: str | PoolSpec | Mapping[str, Any]) -> PoolSpec:
    """The :class:`PoolSpec` a step's config holds, from what a user or a record gives where the
    config is built: a name (:func:`get_pool`), a spec declared in an experiment file, or a spec as
    a run's record holds it (a dict of its fields). A spec that takes the name of one of marin's
    shipped pools with other values is refused in one line: a name means one pool everywhere (in
    ``marin plan``, in the records, to whoever reads them)."""
    if isinstance(pool, str):
        return get_pool(pool)
    if isinstance(pool, Mapping):
        return _spec(pool["name"], pool)
    if not isinstance(pool, PoolSpec):
        raise TypeError(f"a pool is a name or a PoolSpec, got {type(pool).__name__}")
    shipped = SHIPPED.get(pool.name)
    if shipped is not None and shipped != pool:
        changed = ", ".join(f"{f.name}={getattr(pool, f.name)!r}" for f in dataclasses.fields(pool)
                            if getattr(pool, f.name) != getattr(shipped, f.name))
        raise ValueError(f"pool {pool.name!r} is one of marin's shipped pools, and this PoolSpec differs from it "
                         f"({changed}): give yours another name")
    return pool
