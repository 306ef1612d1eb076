"""The launcher: one JAX process per host of a pool, the pool relaunched when a host is lost.

:func:`launch` runs a host function once per host of a pool through the pool's launcher
(:class:`Launcher`, by the pool's ``launcher`` field); marin's is :class:`RayLauncher`:
1. reserve every host with Ray placement groups, one per rack (:mod:`marin.pools.placement`): hosts
   of a rack on distinct nodes (STRICT_SPREAD) and, where the pool names a rack label, all in the
   same rack (STRICT_PACK on it);
2. start one actor per host; host 0 picks the ``jax.distributed`` coordinator address on its node;
3. run the host function everywhere; the first failure kills every host (a JAX peer left alone would
   hang in a collective) and releases the reservation; then retry up to ``max_retries`` times. The
   host function resumes from the latest checkpoint, so a retry loses at most one checkpoint interval.
   With a stall rule, a pool whose hosts stop completing steps counts as failed too
   (:mod:`marin.pools.stall`): a hung host never fails by itself.

This module imports Ray and JAX lazily: experiment files read the pools without either.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from marin.execution.cluster import placement_owner
from marin.execution.failures import StopRequested, host_memory_error, is_infrastructure_failure
from marin.execution.retry import RetryPolicy
from marin.pools.errors import (
    HostOutOfMemory,
    NonRetryableError,
    PoolLaunchError,
    PoolLostError,
    RendezvousError,
    RendezvousFailed,
)
from marin.pools.hostenv import HostContext, check_devices, host_env, join_runtime
from marin.pools.placement import (
    PlacementNote,
    failed_hosts_nodes,
    host_addresses,
    nodes_to_avoid,
    placement_groups,
    wait_for_placement,
)
from marin.pools.spec import PoolSpec
from marin.pools.stall import (
    PoolStalled,
    ProgressWatch,
    StallRule,
    append_stall_record,
    start_reporting,
    stop_reporting,
)

logger = logging.getLogger(__name__)

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
            heartbeat: tuple[Any, StallRule] | None = None, board: Any = None,
            host_setup: Callable[[HostContext], None] | None = None) -> Any:
        import ray  # Ray: only when a pool is launched; planning reads pool specs without it

        if heartbeat is not None:  # the launcher's stall watchdog: report progress to its board
            start_reporting(heartbeat[0], ctx.process_id, heartbeat[1], node=ray.util.get_node_ip_address())
        try:
            if host_setup is not None:
                host_setup(ctx)
            if board is not None:
                ray.get(board.arrive.remote(ctx.process_id))
            try:
                join_runtime(ctx)
            except Exception as e:  # noqa: BLE001 - whatever stopped the rendezvous, the launcher retries it
                raise RendezvousFailed(f"host {ctx.process_id} could not join the start-up rendezvous of pool "
                                       f"{ctx.pool.name}: {_one_line(e)}") from e
            if board is not None:
                ray.get(board.join.remote(ctx.process_id))
            check_devices(ctx)
            return fn(ctx, *args)
        finally:
            stop_reporting()


class RendezvousBoard:
    """Which hosts of one attempt reached the start-up rendezvous and which passed it (a Ray actor the
    launcher starts with a pool of several hosts): a host missing there may have ended, hung before
    it, or be waiting for one that did, and only the board tells them apart afterwards."""

    def __init__(self) -> None:
        self.arrived: set[int] = set()
        self.joined: set[int] = set()

    def arrive(self, host: int) -> None:
        self.arrived.add(host)

    def join(self, host: int) -> None:
        self.joined.add(host)

    def state(self) -> tuple[list[int], list[int]]:
        return sorted(self.arrived), sorted(self.joined)


RENDEZVOUS_BACKOFF_MAX_S = 300.0
"""The longest wait between two attempts at the start-up rendezvous (the backoff doubles up to it)."""

RELAUNCH_BACKOFF = RetryPolicy(first_delay_s=1.0, max_delay_s=30.0)
"""The wait before relaunching a pool after a host failed: 1 s, doubling, at most 30 s."""


def never_joined(board: Any, pool: PoolSpec, groups: list[Any], ended: Mapping[int, BaseException]
                 ) -> list[dict[str, Any]]:
    """The hosts of a failed attempt that never passed the start-up rendezvous, each with its address
    and why (it ended before reaching it, never reached it, or reached it and waited for the others);
    empty when every host joined (the failure came later) or the pool has one host."""
    import ray  # Ray: only when a pool is launched; planning reads pool specs without it

    if board is None:
        return []
    try:
        arrived, joined = ray.get(board.state.remote(), timeout=10)
    except Exception as e:  # noqa: BLE001 - without the board, the failure is judged as a host failure
        logger.warning("the rendezvous board did not answer (%s)", e)
        return []
    if len(joined) == pool.hosts:
        return []
    addresses = host_addresses(groups, pool)
    out = []
    for host in (h for h in range(pool.hosts) if h not in joined):
        if host in arrived:
            why = "reached it and waited for the others"
        elif host in ended:
            why = f"ended before reaching it ({type(_unwrap(ended[host])).__name__})"
        else:
            why = "never reached it"
        out.append({"host": host, "ip": addresses.get(host, "?"), "reached": host in arrived, "why": why})
    return out


def rendezvous_message(pool: PoolSpec, missing: list[dict[str, Any]], failures: int) -> str:
    """One line: the hosts that never joined the start-up rendezvous (those that never reached it
    first: the others waited for them), on which address, after how many failed attempts."""
    culprits = [m for m in missing if not m["reached"]] or missing
    hosts = ", ".join(f"{m['host']} ({m['ip']})" for m in culprits)
    waited = [m["host"] for m in missing if m["reached"] and m not in culprits]
    others = f"; host(s) {', '.join(map(str, waited))} reached it and waited" if waited else ""
    return (f"pool {pool.name}: host(s) {hosts} never joined the start-up rendezvous "
            f"({'; '.join(f'host {m['host']} {m['why']}' for m in culprits)}{others}), "
            f"{failures} failed attempt(s) of {pool.rendezvous_retries + 1} allowed, "
            f"{pool.rendezvous_timeout_s:g} s each (the pool's rendezvous_timeout_s and rendezvous_retries)")



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


class Launcher(Protocol):
    """What starts a pool's hosts and runs the host function on each: the seam for another kind of
    cluster. A launcher of another kind (a Slurm allocation's ``srun``, a TPU pod's workers) implements
    this, is registered under a name with :func:`register_launcher`, and a pool names it in its
    ``launcher`` field; the trainer, evaluation and sampling call :func:`launch` and never know which.
    It owes the contract of :class:`RayLauncher`: the results in host order, a :class:`HostContext`
    per host (its index, the host count, the coordinator address, the pool), the whole pool killed
    and relaunched after a host failure (up to ``max_retries``) or a failed start-up rendezvous (up to
    the pool's ``rendezvous_retries``, as :class:`RendezvousError` naming the hosts that never joined),
    infrastructure failures raised as :class:`PoolLostError` and the host's own errors as they are."""

    def launch(self, pool: PoolSpec, fn: Callable[..., Any], args: Sequence[Any], *, max_retries: int | None,
               stall: StallRule | None, stall_log: str | None, step_dir: str | None,
               host_setup: Callable[[HostContext], None] | None = None) -> list[Any]: ...


class RayLauncher:
    """The launcher of this module's docstring: Ray placement groups, one Ray actor per host."""

    def launch(self, pool: PoolSpec, fn: Callable[..., Any], args: Sequence[Any], *, max_retries: int | None,
               stall: StallRule | None, stall_log: str | None, step_dir: str | None,
               host_setup: Callable[[HostContext], None] | None = None) -> list[Any]:
        import ray  # Ray: only when a pool is launched; planning reads pool specs without it
        from ray.util.placement_group import remove_placement_group  # (the same)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # (the same)

        retries = pool.max_retries if max_retries is None else max_retries
        host_cls, board_cls = ray.remote(_Host), ray.remote(RendezvousBoard)
        errors: list[str] = []
        last_cause = ""
        failures = rendezvous_failures = 0  # two budgets: max_retries and the pool's rendezvous_retries
        note, owner = PlacementNote(step_dir), placement_owner(step_dir)
        attempt = 0
        while True:
            attempt += 1
            avoid = nodes_to_avoid(pool, note)
            groups = placement_groups(pool, owner, avoid)
            actors: list[Any] = []
            refs: list[Any] = []  # the hosts' results, once started
            watch: ProgressWatch | None = None
            board: Any = None  # which hosts reached and passed the start-up rendezvous (several hosts only)
            try:
                wait_for_placement(pool, groups, lambda avoid=avoid: placement_groups(pool, owner, avoid), note)
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
                board = board_cls.options(num_cpus=0, max_restarts=0).remote() if pool.hosts > 1 else None
                watch = ProgressWatch(stall, pool.hosts) if stall is not None else None
                heartbeat = (watch.board, stall) if watch is not None else None
                refs = [
                    a.run.remote(fn, HostContext(i, pool.hosts, coordinator, pool), tuple(args), heartbeat, board,
                                 host_setup)
                    for i, a in enumerate(actors)
                ]
                _wait_for_hosts(refs, watch, pool, attempt, stall_log)
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
                missing = never_joined(board, pool, groups, ended)
                if missing:  # the start-up rendezvous failed: its own budget, its own backoff
                    rendezvous_failures += 1
                    note.add_rendezvous_failure(attempt, missing)
                    message = rendezvous_message(pool, missing, rendezvous_failures)
                    if rendezvous_failures > pool.rendezvous_retries:
                        raise RendezvousError(message) from None
                    logger.warning("%s; relaunching the pool (rendezvous attempt %d of %d)", message,
                                   rendezvous_failures + 1, pool.rendezvous_retries + 1)
                    backoff = RetryPolicy(first_delay_s=pool.rendezvous_backoff_s, max_delay_s=RENDEZVOUS_BACKOFF_MAX_S)
                    delay = backoff.delay(rendezvous_failures)
                else:
                    failures += 1
                    note.add_bad_nodes(failed_hosts_nodes(groups, pool, ended))
                    errors.append(f"attempt {attempt}: {type(inner).__name__}: {inner}")
                    last_cause = _one_line(inner)
                    logger.warning("pool %s failed (attempt %d/%d): %s", pool.name, failures, retries + 1, inner)
                    if failures > retries:
                        break
                    delay = RELAUNCH_BACKOFF.delay(failures)  # a lost node may take a while to be replaced
            finally:
                for a in actors:
                    ray.kill(a, no_restart=True)
                for g in groups:
                    remove_placement_group(g)
                if watch is not None:
                    watch.close()
                if board is not None:
                    ray.kill(board, no_restart=True)
            time.sleep(delay)
        # The first line is what a step's recorded failure reason shows: it must carry the cause itself.
        raise PoolLostError(f"pool {pool.name} failed after {failures} attempt(s); last: {last_cause}\n"
                            + "\n".join(errors))


LAUNCHERS: dict[str, Launcher] = {"ray": RayLauncher()}
"""The launchers by the name a pool's ``launcher`` field gives."""


def register_launcher(kind: str, launcher: Launcher) -> None:
    """Make ``launcher`` start the pools whose ``launcher`` field is ``kind`` (a name already taken by
    another launcher is refused: one name, one launcher)."""
    if LAUNCHERS.get(kind, launcher) is not launcher:
        raise ValueError(f"launcher {kind!r} is already registered; give yours another name")
    LAUNCHERS[kind] = launcher


def launch(
    pool: PoolSpec, fn: Callable[..., Any], args: Sequence[Any] = (), *, max_retries: int | None = None,
    stall: StallRule | None = None, stall_log: str | None = None,
    step_dir: str | None = None, host_setup: Callable[[HostContext], None] | None = None,
) -> list[Any]:
    """Run ``fn(ctx, *args)`` once per host of ``pool``; returns the per-host results in host order.

    Needs an initialised Ray (the executor's step task has one). Raises the host's exception for
    ``NonRetryableError``, else ``PoolLaunchError`` after ``max_retries`` (default: the pool's) retries.
    ``stall``: watch the hosts' heartbeat (:mod:`marin.pools.stall`; ``fn`` reports its steps with
    ``report_step``) and relaunch a pool that stops completing steps, recording each stall in the JSON
    list at ``stall_log``.
    ``step_dir``: the step's directory, where the launcher notes what its reservation waits for,
    which nodes it leaves out and each failed start-up rendezvous (:class:`PlacementNote`, read by
    ``marin status``); its placement groups are named after it.
    ``host_setup``: run on each host before it joins the pool's runtime (a site's per-host preparation);
    a host that ends or hangs there fails the rendezvous like one that cannot reach its coordinator.
    """
    return launcher_of(pool).launch(pool, fn, args, max_retries=max_retries, stall=stall, stall_log=stall_log,
                                    step_dir=step_dir, host_setup=host_setup)


def launcher_of(pool: PoolSpec) -> Launcher:
    """The launcher of ``pool``: its ``launcher`` field names a registered kind (``"ray"``), or
    ``"module:kind"``, the kind that importing ``module`` registers. The process that launches a pool is
    the Ray worker running the step, which never ran the experiment file (or site module) that
    registered the kind in the driver; the module path is how the registration reaches it: the module
    is imported here, where the kind is not registered yet."""
    module, _, kind = pool.launcher.rpartition(":")
    if kind not in LAUNCHERS and module:
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - a module that does not import: said in one line
            raise PoolLaunchError(f"pool {pool.name}: launcher {pool.launcher!r}: importing {module} failed in "
                                  f"this process ({_one_line(e)}); it must be importable where "
                                  "the pool is launched (on the workers' PYTHONPATH)") from None
    if kind in LAUNCHERS:
        return LAUNCHERS[kind]
    known = ", ".join(sorted(LAUNCHERS))
    if module:
        raise PoolLaunchError(f"pool {pool.name}: importing {module} registered no launcher {kind!r} (known: {known}); "
                              f"it must call register_launcher({kind!r}, ...) when imported")
    raise PoolLaunchError(f"pool {pool.name}: no launcher {kind!r} in this process (known: {known}); a launcher "
                          f"registered elsewhere is named with its module, launcher = \"<module>:{kind}\"")
