"""A step's Ray task: what the task runs, the options it is submitted with, and how a failure reads.

The driver (:mod:`marin.execution.executor`) submits one task per step attempt with
:func:`submit`. The task's body checks that its blocking inputs are SUCCESS (another driver may have
rerun one while the task waited in Ray's queue), creates the step's directory and calls the step's
function; it returns when the body began, for the step's record.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import time
import traceback
from typing import Any

from marin.execution import status as st
from marin.execution import storage
from marin.execution.cluster import placement_owner
from marin.execution.failures import InputNotSucceeded, disk_full_error
from marin.execution.fingerprint import code_fingerprint
from marin.execution.jsonable import mask_leaves, mask_log_records, mask_text, to_jsonable
from marin.execution.plan import PlannedStep
from marin.execution.status import StepStatus
from marin.textfmt import format_bytes


def step_info(ps: PlannedStep, config: Any, holder: str) -> dict[str, Any]:
    """What the step is, as this attempt runs it: its name, code, resolved config, version, lineage,
    resources and host; the lease carries it and the step's record takes it over."""
    deps = ps.dependencies + ps.nonblocking_dependencies
    return {
        "name": ps.name,
        "description": mask_text(ps.step.description) if ps.step.description else None,
        "output_path": ps.output_path,
        "hash": ps.hash,
        "fn": code_fingerprint(ps.step.fn)["fn"],
        "code_fingerprint": code_fingerprint(ps.step.fn),
        "config": to_jsonable(config),
        "version": {**ps.version(), "config": mask_leaves(ps.config_leaves)},
        "dependencies": [d.output_path for d in deps],
        "resources": ps.step.resources or {},
        "host": socket.gethostname(),
        "holder": holder,
    }


def execute_step(fn: Any, config: Any, output_path: str, inputs: tuple[tuple[str, str], ...] = ()) -> None:
    """Body of a step's Ray task; ``inputs``: (name, output path) of each blocking dependency."""
    mask_log_records()  # this worker's log lines, the step's own included, as the driver's
    check_inputs_succeeded(inputs)
    storage.makedirs(output_path)
    fn(config)


def check_inputs_succeeded(inputs: tuple[tuple[str, str], ...]) -> None:
    """Refuse to start a step whose blocking inputs ((name, output path) pairs) are not all SUCCESS
    now: the driver submits a step only after its inputs' SUCCESS, but a step may wait in Ray's queue
    for a while, and another driver may rerun an input meanwhile."""
    for name, path in inputs:
        status = st.current_status(st.read_status(path))
        if status != StepStatus.SUCCESS:
            raise InputNotSucceeded(f"input {name} ({path}) is {status.value if status else 'not started'}, "
                                    "not SUCCESS, when this step started: not reading it")


_REMOTE_BODIES: dict[int, tuple[Any, Any]] = {}
"""id(step function) -> (the function, its Ray remote function): one per function per process."""


def remote_body(fn: Any) -> Any:
    """The Ray remote function that runs ``fn``'s steps, created once per step function.

    Ray exports (pickles and uploads) a remote function the first time it is called; creating one
    per step would export it again for every step and pickle ``fn`` into every task's arguments.
    Per-step options (name, resources) are applied with ``.options()``, which exports nothing."""
    entry = _REMOTE_BODIES.get(id(fn))
    if entry is None or entry[0] is not fn:
        import ray  # Ray only once steps run: planning and review import this module

        def run_step(args: bytes) -> float:
            started = time.time()
            execute_step(fn, *ray.cloudpickle.loads(args))
            return started  # when the body began: the step may have waited in Ray's queue before

        entry = _REMOTE_BODIES[id(fn)] = (fn, ray.remote(run_step))
    return entry[1]


def blocking_inputs(ps: PlannedStep) -> tuple[tuple[str, str], ...]:
    """(name, output path) of each dependency ``ps`` must not start before (see :func:`check_inputs_succeeded`)."""
    return tuple((d.name, d.output_path) for d in ps.dependencies)


def ray_options(ps: PlannedStep) -> dict[str, Any]:
    res = dict(ps.step.resources or {})
    opts: dict[str, Any] = {"num_cpus": res.pop("num_cpus", 1), "max_retries": 0, "name": ps.name}
    for key in ("num_gpus", "memory", "accelerator_type", "resources"):
        if key in res:
            opts[key] = res[key]
    return opts


def infeasible(options: dict[str, Any], cluster: dict[str, float]) -> dict[str, float]:
    """The part of a task's resource request that exceeds the whole cluster's capacity."""
    want = {"CPU": options.get("num_cpus", 1), "GPU": options.get("num_gpus", 0), **options.get("resources", {})}
    if options.get("accelerator_type"):
        want[f"accelerator_type:{options['accelerator_type']}"] = 0.001
    return {k: v for k, v in want.items() if v and cluster.get(k, 0) < v}


def describe_failure(exc: BaseException) -> tuple[str, str]:
    """(one-line error, full traceback text) for an exception raised by ``ray.get`` of a step."""
    import ray.exceptions as rex  # Ray only once steps run: planning and review import this module

    if isinstance(exc, rex.RayTaskError):
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
        remote = getattr(exc, "traceback_str", None) or str(exc)
        remote = re.sub(r"\x1b\[[0-9;]*m", "", remote).strip()
        if not remote.startswith("Traceback"):
            remote = "Traceback of the step (remote, most recent call last):\n" + remote
        return f"{type(cause).__name__}: {cause}".splitlines()[0][:500], remote
    if isinstance(exc, (rex.WorkerCrashedError, rex.NodeDiedError)) or "worker died" in str(exc).lower():
        return (
            "the step's worker process died while running it (killed, crashed, out of memory or os._exit)",
            str(exc),
        )
    if isinstance(exc, rex.TaskCancelledError):
        return "the step's task was cancelled", str(exc)
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:500], "".join(traceback.format_exception(exc))


def disk_full_message(err: OSError, s: PlannedStep) -> str:
    """What a person reads when step ``s`` (or its record) found the disk full: where, how much is
    left, and what to do (a rerun fails the same way until space is freed, so it is not retried)."""
    where = err.filename if isinstance(err.filename, str) else None
    try:
        usage = shutil.disk_usage(where if where and os.path.exists(where) else s.output_path)
        room = f"{format_bytes(usage.free)} free of {format_bytes(usage.total)}"
    except OSError:  # an object-store output (the step filled a local scratch disk) or a vanished path
        room = None
    what = err.strerror or os.strerror(err.errno)
    if where:
        said = f"disk full: {what} writing {where}" + (f" ({room} there)" if room else "")
    else:
        said = f"disk full: {what}" + (f" (the step's output directory {s.output_path} has {room})" if room else "")
    return f"{said}; free space, then rerun with --retry_failed {s.name}"


def describe_write_error(e: BaseException, s: PlannedStep) -> str:
    """One line for a failed bookkeeping write of step ``s``: the disk-full message, or the error."""
    full = disk_full_error(e)
    return disk_full_message(full, s) if full is not None else f"{type(e).__name__}: {e}".splitlines()[0][:500]


def task_args(ps: PlannedStep, config: Any) -> bytes:
    """The arguments of ``ps``'s task (its resolved ``config``, output path and blocking inputs),
    pickled as Ray would pickle them (``ray.cloudpickle``, by value where registered so).

    Pickled by the driver ahead of submission (:func:`submit` passes bytes, which Ray ships as they
    are): the driver can do it while the cluster starts instead of in its loop, where pickling a
    config class defined in the experiment file itself is most of a submission's cost."""
    import ray.cloudpickle  # Ray only once steps run: planning and review import this module

    return ray.cloudpickle.dumps((config, ps.output_path, blocking_inputs(ps)))


def submit(ps: PlannedStep, args: bytes) -> Any:
    """Submit one attempt of ``ps`` as a Ray task with its :func:`task_args`; its object ref."""
    return remote_body(ps.step.fn).options(**ray_options(ps)).remote(args)


POOL_WAITS_EVERY_S = 2.0
"""How often the progress bar's count of steps waiting for a busy pool is refreshed (one call to Ray)."""


class PoolWaits:
    """How many running steps wait for a pool reservation the cluster can hold but others hold now
    (their placement groups, named after the step, are pending), for the progress bar: looked up at
    most every :data:`POOL_WAITS_EVERY_S`, the last count given in between."""

    def __init__(self) -> None:
        self._at, self._n = 0.0, 0

    def count(self, running: list[PlannedStep]) -> int:
        now = time.monotonic()
        if now - self._at < POOL_WAITS_EVERY_S or not running:
            return self._n if running else 0
        self._at = now
        try:
            from ray.util.placement_group import placement_group_table  # Ray only once steps run (see above)

            pending = [t["name"] for t in placement_group_table().values() if t["state"] == "PENDING"]
        except Exception:  # noqa: BLE001 - a count for the progress bar; the run does not depend on it
            return self._n
        owners = {placement_owner(s.output_path) for s in running}
        self._n = len({o for o in owners if any(name.startswith(o) for name in pending)})
        return self._n
