"""The Ray cluster a run uses: join one (with its authentication token) or start a fresh local one,
and shut a local one down completely.

Ray is imported only here and only when a step must actually run, so planning, dry runs and review
never pay for it. The scheduler (:mod:`marin.execution.executor`) calls :func:`ensure_ray` before it
submits the first step and :func:`shutdown_local_ray` when a cluster it started is done.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any, TypeVar

from marin.execution.errors import ExecutorError
from marin.execution.reaper import REAPER_SCRIPT, STOPPED, descendants, stop_processes
from marin.execution.signals import RunStopped, stop_signals_held

logger = logging.getLogger("marin.execution")
T = TypeVar("T")


FIXED_CLUSTER_ENV = "MARIN_RAY_CLUSTER_FIXED"
"""Set (to "1") in the environment of a local cluster the executor starts, and so of its steps: that
cluster never gains nodes, so a placement no node can hold fails at once instead of waiting for an
autoscaler (see :func:`cluster_can_grow`)."""


def cluster_can_grow() -> bool:
    """Whether the Ray cluster this process runs in may gain nodes (an autoscaler, an operator adding
    workers): False only on the local cluster the executor started."""
    return os.environ.get(FIXED_CLUSTER_ENV) != "1"


def placement_owner(step_dir: str | None) -> str:
    """How a step's placement groups are named first (``"<step directory name> "``), so the driver
    and ``marin status`` can tell whose reservation waits or holds what; "" for no step."""
    return f"{os.path.basename(step_dir.rstrip('/'))} " if step_dir else ""


def ensure_ray(address: str | None) -> bool:
    """Join ``address`` (or ``RAY_ADDRESS``), or start a fresh local cluster: the embedded default.

    Returns True when this call started a local cluster, which the caller then owns and shuts down
    (:func:`shutdown_local_ray`)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray = import_ray_for_the_driver()
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        token = use_ray_token_if_present()
        try:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
        except Exception as e:
            raise ExecutorError(join_failure(address, token, e)) from None
        return False
    quiet_default_token_notice()
    os.environ[FIXED_CLUSTER_ENV] = "1"  # before ray.init: its processes (and the steps) inherit it
    _watchdogs.append(start_watchdog())
    try:
        with ray_sigterm_handler_left_out(ray):
            retry_startup_timeouts(lambda: ray.init(address="local", include_dashboard=False,
                                                    logging_level=logging.WARNING, log_to_driver=True),
                                   "the local Ray cluster")
    except SystemExit:
        # a Ray whose SIGTERM handler could not be left out exits from it: a SIGTERM while the
        # cluster starts is a stop like any other
        raise RunStopped(signal.SIGTERM) from None
    except BaseException:  # a signal (or an error) halfway through: stop whatever part of it started
        if ray.is_initialized():
            shutdown_local_ray()
        raise
    return True


@contextlib.contextmanager
def ray_sigterm_handler_left_out(ray: ModuleType) -> Iterator[None]:
    """``ray.init`` without the SIGTERM handler it installs first thing (``sys.exit``, no stop path), so
    that the driver's own stop signals (:mod:`marin.execution.signals`) hold through the start.

    Ray's handler raised SystemExit wherever the signal landed, also where Python only prints an
    exception and goes on (``logging``'s fork handlers: the stop was lost), and it stayed installed
    when the start was cut short, so the next SIGTERM of a burst (schedulers send several) exited the
    driver halfway through its stop, or killed it without a word once its handlers were put back to
    the default. Ray's helper is not public API: on a Ray without it, the caller's handler is put
    back as soon as the start returns or is cut short."""
    utils = getattr(getattr(ray, "_private", None), "utils", None)
    original = getattr(utils, "set_sigterm_handler", None)
    caller = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    if original is not None:
        utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        if original is not None:
            utils.set_sigterm_handler = original
        if caller is not None and signal.getsignal(signal.SIGTERM) is not caller:
            signal.signal(signal.SIGTERM, caller)


_watchdogs: list[tuple[subprocess.Popen, int]] = []
"""The watchdog of the local cluster :func:`ensure_ray` started, until :func:`shutdown_local_ray`."""


def start_watchdog(grace_s: float = 5.0) -> tuple[subprocess.Popen, int]:
    """Start the watchdog (:mod:`marin.execution.reaper`) that stops what a local cluster about to
    start would leave running if this process were killed outright; returns it with the write end
    of its pipe, for :func:`stop_watchdog` once the cluster is stopped."""
    read, write = os.pipe()  # not inherited by what this process starts: only its death closes the pipe
    try:
        # the script alone, standard library only (-I -S): not the package's imports, on a CPU the
        # cluster's start is waiting for
        proc = subprocess.Popen([sys.executable, "-I", "-S", REAPER_SCRIPT, str(os.getpid()), str(grace_s)],
                                stdin=read, stdout=subprocess.DEVNULL, start_new_session=True)
    finally:
        os.close(read)
    return proc, write


def stop_watchdog(watchdog: tuple[subprocess.Popen, int]) -> None:
    """Tell the watchdog the cluster was stopped here, and let it exit."""
    proc, write = watchdog
    with contextlib.suppress(OSError):
        os.write(write, STOPPED)
    os.close(write)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def retry_startup_timeouts(start: Callable[[], T], what: str) -> T:
    """``start()`` (a Ray cluster or node starting), called again after a start whose node missed
    Ray's startup deadline, up to :data:`LOCAL_START_ATTEMPTS` times, each time after stopping the
    processes the failed start spawned (the half-started node is registered nowhere else); an
    :class:`ExecutorError` in one line when none started. Other errors pass through."""
    attempt = 0
    while True:
        attempt += 1
        before = set(descendants(os.getpid()))
        try:
            return start()
        except Exception as e:
            if not is_startup_timeout(e):
                raise
            stop_processes([p for p in descendants(os.getpid()) if p not in before], grace_s=2.0)
            if attempt == LOCAL_START_ATTEMPTS:
                raise ExecutorError(local_start_failure(LOCAL_START_ATTEMPTS)) from None
            logger.warning("%s did not come up within Ray's 30 s (attempt %d of %d); starting it again", what,
                           attempt, LOCAL_START_ATTEMPTS)


LOCAL_START_ATTEMPTS = 3
"""How often the executor starts a local cluster whose node misses Ray's startup deadline (30 s for
the raylet to register, fixed in Ray): on an overloaded machine the first start can miss it and the
next one succeed."""


def is_startup_timeout(exc: BaseException) -> bool:
    """Ray's error for a node whose raylet did not register with the GCS in time (a plain Exception)."""
    return "timed out during startup" in str(exc)


def local_start_failure(attempts: int) -> str:
    load = f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores" if hasattr(os, "getloadavg") else ""
    return (f"could not start a local Ray cluster: its node missed Ray's 30 s startup deadline {attempts} times"
            f"{f' ({load})' if load else ''}; rerun when the machine is less busy, or start a cluster with "
            "`ray start --head` and pass its address with --address")


RAY_TOKEN_LOGGER = "ray._private.authentication.authentication_token_setup"
DEFAULT_TOKEN_NOTICE = "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled"
"""What Ray logs at WARNING on every start of a local cluster with its default, token
authentication on: news on every run, not a warning. Ray's warning that authentication is *off*
(``RAY_AUTH_MODE=disabled``) and its errors are kept."""


class _DropDefaultTokenNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(DEFAULT_TOKEN_NOTICE)


def quiet_default_token_notice() -> None:
    """Drop :data:`DEFAULT_TOKEN_NOTICE` at its source logger (once per process)."""
    source = logging.getLogger(RAY_TOKEN_LOGGER)
    if not any(isinstance(f, _DropDefaultTokenNotice) for f in source.filters):
        source.addFilter(_DropDefaultTokenNotice())


NO_FAILURE_SIGNAL_HANDLER = "RAY_DISABLE_FAILURE_SIGNAL_HANDLER"


def import_ray_for_the_driver() -> ModuleType:
    """``import ray``, without Ray's C++ failure signal handler in this process (the driver).

    That handler takes SIGTERM over (it prints C++ stack lines), and ``ray.shutdown`` puts SIGTERM
    back to the default action behind Python's back, so a SIGTERM while the cluster stops would end
    the driver at once, without its message or its final record. The driver's stop signals are
    Python's (:mod:`marin.execution.signals`). Ray reads the setting when it is imported, so it is set
    only for the import: the processes the cluster starts keep Ray's handler. Where Ray was imported
    earlier, :func:`run_plan` installs the driver's handlers again after the shutdown."""
    if "ray" in sys.modules:
        return sys.modules["ray"]
    before = os.environ.get(NO_FAILURE_SIGNAL_HANDLER)
    os.environ[NO_FAILURE_SIGNAL_HANDLER] = "1"
    try:
        import ray  # Ray only when a cluster is joined or stopped
    finally:
        if before is None:
            del os.environ[NO_FAILURE_SIGNAL_HANDLER]
        else:
            os.environ[NO_FAILURE_SIGNAL_HANDLER] = before
    return ray


def build_serialization_context() -> None:
    """Build Ray's serialization context for this process now, ahead of ``ray.init``.

    Ray builds it at the first task submission (it imports its serializers for pydantic, starlette
    and Arrow: 0.15 CPU-seconds on the development VM, several times that in wall time on a loaded
    machine), and hands a context built before ``ray.init`` over to the job it joins
    (``Worker.get_serialization_context``). The driver builds it while the cluster starts (the
    preparing thread of :func:`marin.execution.executor.run_plan`), so the first submission does not
    wait for it. Ray's own worker object is not public API: on a Ray without it nothing happens here
    and the first submission builds the context as before."""
    ray = import_ray_for_the_driver()
    worker = getattr(getattr(getattr(ray, "_private", None), "worker", None), "global_worker", None)
    if worker is None or not hasattr(worker, "get_serialization_context"):
        return
    try:
        worker.get_serialization_context()
    except Exception as e:  # noqa: BLE001 - the first submission builds it again and says what fails
        logger.debug("could not build Ray's serialization context ahead: %s", e)


RAY_TOKEN_FILE = os.path.join("~", ".ray", "auth_token")
"""Where ``ray start`` and ``ray get-auth-token --generate`` keep the cluster token by default."""


def ray_token_source() -> str | None:
    """Where a Ray authentication token is available to this process (env var or file), else None."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "$RAY_AUTH_TOKEN"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path and os.path.isfile(path):
        return path
    default = os.path.expanduser(RAY_TOKEN_FILE)
    return default if os.path.isfile(default) else None


def use_ray_token_if_present() -> str | None:
    """Turn on Ray's token authentication for this driver when a token is available; return its source.

    Ray clusters use token authentication by default, but a driver given an explicit address only
    sends its token when ``RAY_AUTH_MODE=token``. An explicit ``RAY_AUTH_MODE`` is left alone."""
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None:
        return ray_token_source() if mode.lower() == "token" else None
    source = ray_token_source()
    if source is None:
        return None
    os.environ["RAY_AUTH_MODE"] = "token"
    if "ray._raylet" in sys.modules:  # Ray read its config already: make it see the new mode
        try:
            from ray._raylet import AuthenticationTokenLoader, Config  # Ray only when a cluster is joined

            Config.initialize("")
            AuthenticationTokenLoader.instance().reset_cache()
        except Exception as e:  # pragma: no cover - a Ray without these internals
            logger.debug("could not refresh Ray's auth config: %s", e)
    return source


def join_failure(address: str, token: str | None, exc: BaseException) -> str:
    cause = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if token:
        return (f"could not join the Ray cluster at {address} ({cause}) using the token from {token}: check that "
                "the cluster is up and that the token matches `ray get-auth-token` on its head node")
    return (f"could not join the Ray cluster at {address} ({cause}); if it uses token authentication (Ray's "
            "default), put the output of `ray get-auth-token` on its head node into ~/.ray/auth_token "
            "(or set RAY_AUTH_TOKEN) and rerun")


def shutdown_local_ray(grace_s: float = 5.0) -> None:
    """Stop the local cluster this process started, including the agents its raylet spawned.

    ``ray.shutdown`` stops the processes ``ray.init`` started (GCS, raylet, ...), but the dashboard
    and runtime-env agents are the raylet's children and notice its death only by polling, so they
    would outlive the run by minutes. They are ours (started for this run), so we stop them by pid
    (checking each one's start time, so a reused pid is never signalled)."""
    import ray  # Ray only when a cluster is joined or stopped

    node = getattr(ray._private.worker, "_global_node", None)
    owned = node_descendants(node) if node is not None else []
    ray.shutdown(wait_for_processes=True)
    stop_processes(owned, grace_s)
    while _watchdogs:
        stop_watchdog(_watchdogs.pop())


def node_descendants(node) -> list[tuple[int, str]]:
    """``(pid, start time)`` of every process below a Ray node's raylet and GCS (its agents)."""
    owned: list[tuple[int, str]] = []
    for name in ("raylet", "gcs_server"):
        for info in node.all_processes.get(name, []):
            if info.process is not None:
                owned += descendants(info.process.pid)
    return owned


def add_node_retrying(cluster, spec: Mapping[str, Any]) -> None:
    """``cluster.add_node(**spec)``, started again after a node that missed Ray's startup deadline
    (:func:`retry_startup_timeouts`)."""
    retry_startup_timeouts(lambda: cluster.add_node(**dict(spec)), "a simulated Ray node")


@contextlib.contextmanager
def local_cluster_with_nodes(nodes: Sequence[Mapping[str, Any]], *, grace_s: float = 5.0) -> Iterator[str]:
    """A fresh local Ray cluster of this machine's head node plus one simulated node per entry of
    ``nodes`` (each: ``num_cpus``, ``resources``, ``labels``, as :meth:`ray.cluster_utils.Cluster.add_node`
    takes them), joined by this process for the ``with`` block and stopped completely after it
    (agents included); yields its address. Like the local cluster :func:`ensure_ray` starts, it
    never grows (:data:`FIXED_CLUSTER_ENV`). Each simulated node is a raylet of its own on this
    machine, so a pool's hosts land on distinct nodes as on a real cluster; Ray's own cluster
    utilities start them (about 10 s a node on a small machine)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray = import_ray_for_the_driver()
    if ray.is_initialized():
        raise ExecutorError("a Ray cluster is already joined in this process: simulated nodes need a fresh one")
    from ray.cluster_utils import Cluster  # Ray only when a cluster is started (see above)

    quiet_default_token_notice()
    before = os.environ.get(FIXED_CLUSTER_ENV)
    os.environ[FIXED_CLUSTER_ENV] = "1"  # before the nodes start: their workers (the pool's hosts) inherit it
    watchdog = start_watchdog(grace_s)
    cluster = Cluster()
    owned: list[tuple[int, str]] = []
    try:
        for spec in [{"num_cpus": os.cpu_count() or 1, "include_dashboard": False}, *nodes]:
            add_node_retrying(cluster, spec)
        ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=True)
        cluster.wait_for_nodes()
        yield cluster.address
    finally:
        with stop_signals_held():  # a second Ctrl-C must not leave agents behind, nor a node still joined
            for node in [*cluster.worker_nodes, cluster.head_node]:
                if node is not None:
                    owned += node_descendants(node)
            if ray.is_initialized():
                ray.shutdown()
            cluster.shutdown()
            stop_processes(owned, grace_s)
            stop_watchdog(watchdog)
            if before is None:
                os.environ.pop(FIXED_CLUSTER_ENV, None)
            else:
                os.environ[FIXED_CLUSTER_ENV] = before
