"""Placement: reserving a pool's hosts on the Ray cluster (one placement group per rack), queueing
for a busy cluster, and leaving out the nodes on which a host of the step failed."""

from __future__ import annotations

import json
import logging
import random
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from marin.execution import storage
from marin.execution.cluster import cluster_can_grow
from marin.pools.errors import PoolInfeasibleError, PoolLaunchError
from marin.pools.spec import PoolSpec

logger = logging.getLogger(__name__)

def placement_groups(pool: PoolSpec, owner: str = "", avoid: Sequence[str] = ()) -> list[Any]:
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

    def add_rendezvous_failure(self, attempt: int, missing: list[dict[str, Any]]) -> None:
        """An attempt whose hosts did not all join the start-up rendezvous: which never joined and why."""
        self.state.setdefault("rendezvous_failures", []).append(
            {"attempt": attempt, "time": time.time(), "never_joined": missing})
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


def host_addresses(groups: list[Any], pool: PoolSpec) -> dict[int, str]:
    """The address of the node each host of a placement was given, by host index ("?" for a bundle
    Ray did not place)."""
    import ray  # Ray: only when a pool is launched; planning reads pool specs without it
    from ray.util.placement_group import placement_group_table  # (the same)

    addresses = {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes()}
    out = {}
    for host in range(pool.hosts):
        node = placement_group_table(groups[host // pool.hosts_per_rack])["bundles_to_node_id"].get(
            host % pool.hosts_per_rack)
        out[host] = addresses.get(node, "?")
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


