"""Running a plan: leases, status files and one Ray task per step.

The driver (this process) owns all bookkeeping: it takes each step's lease, which records the
attempt and what it runs (the step reads RUNNING; see :mod:`status`), submits ``fn(config)`` as a Ray
task with the step's resources, and when the task ends writes FAILED, or, under the step's lock,
checks it still holds the lease and writes SUCCESS last.
A heartbeat thread renews every held lease; a lease lost to a takeover cancels the task and writes
nothing more.

A step is submitted only once each of its blocking dependencies has its final SUCCESS committed
(in this run, or found so): an upstream that is retried (an infrastructure failure resubmitted by
the executor, a pool relaunched by its launcher inside the step's task, a rerun with
``--retry_failed``) holds its dependents back until its last attempt succeeds, so no dependent ever
reads a half-finished output. The step's task checks again when it starts and refuses an input
whose status is not SUCCESS then (another driver may have rerun it meanwhile): one line, and the
step is recorded DEP_FAILED, which the next run starts again by itself. An upstream that did not
succeed turns its dependents into DEP_FAILED. At most a window of steps (four per cluster CPU, at
least 32) is submitted at once, so leases are held only by steps that are about to run.

Several drivers may run the same experiment at once: a step whose lease is held by a live driver is
waited for and its result reused, so each step body runs exactly once.

This module is the scheduler; joining or starting a Ray cluster, its authentication and shutting a
local one down are :mod:`marin.execution.cluster`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tqdm import tqdm

from marin.execution import lease as leases
from marin.execution import retry, storage
from marin.execution import status as st
from marin.execution.cluster import ensure_ray, placement_owner, shutdown_local_ray
from marin.execution.errors import (
    ExecutorError,
    ExecutorInterrupted,
    PreviouslyFailedError,
    UnreadableRecordError,
)
from marin.execution.experiment_record import new_run_id, write_experiment_record
from marin.execution.failures import (
    STORE_ADVICE,
    InputNotSucceeded,
    StopRequested,
    disk_full_error,
    error_chain,
    is_infrastructure_failure,
    unreadable_store_message,
)
from marin.execution.fingerprint import code_fingerprint, drift
from marin.execution.jsonable import mask_argv, mask_leaves, mask_text, to_jsonable
from marin.execution.plan import Plan, PlannedStep, resolve_config
from marin.execution.signals import (
    STOP_RESERVE_S,
    STOP_SIGNALS,
    StopSignals,
    clear_stop_request,
    request_stop,
    signal_of,
    stop_reason,
)
from marin.execution.status import StepStatus
from marin.textfmt import format_bytes

logger = logging.getLogger("marin.execution")


INTERRUPT_RETRY_S = 10.0
"""How long recording an interruption rides out a store outage: a person waits for the prompt, and a
scheduler's grace period (30 s on Kubernetes by default) is short."""


POOL_WAITS_EVERY_S = 2.0
"""How often the progress bar's count of steps waiting for a busy pool is refreshed (one call to Ray)."""


@dataclasses.dataclass
class RunOptions:
    prefix: str
    dry_run: bool = False
    force_run_failed: bool = False
    run_only: list[str] | None = None
    max_concurrent: int | None = None
    address: str | None = None
    lease_ttl: float = leases.DEFAULT_TTL_S
    poll_interval: float = 0.5
    description: str | None = None
    card: dict[str, str] | None = None  # hypothesis, goal, risks, contingency (marin.execution.main)
    script: str = "experiment"
    progress: bool = True
    repair_records: bool = False
    infra_retries: int | None = None
    """Times every step is resubmitted after an infrastructure failure (see :mod:`failures`); 0: never;
    None: each step's own ``ExecutorStep.infra_retries`` (none where unset)."""
    retry_failed: list[str] | None = None
    """Regexes of step names whose earlier FAILED attempt may be rerun (``--force_run_failed`` for a few)."""
    run_id: str = dataclasses.field(default_factory=lambda: new_run_id())
    """This run's name among its experiment's records (see :func:`experiment_runs_dir`)."""


@dataclasses.dataclass
class RunResult:
    plan: Plan
    outcome: dict[str, str]
    """output path -> one of: cached, succeeded, reused, failed, dep_failed, lost, not_selected, dry_run."""
    record_path: str | None
    errors: dict[str, str] = dataclasses.field(default_factory=dict)

    def finished(self, step: Any) -> bool:
        """Whether ``step`` (an ExecutorStep of the plan) has its outputs after this run: it ran and
        succeeded, or had succeeded before. A closing summary reads only such steps' outputs (with
        ``--run_only`` the others may never have run)."""
        return self.outcome.get(self.plan.planned(step).output_path) in ("cached", "succeeded", "reused")


# ----------------------------------------------------------------------------------------------- #
# selection                                                                                        #
# ----------------------------------------------------------------------------------------------- #


def read_statuses(plan: Plan) -> dict[PlannedStep, dict | None]:
    """Status records of every step; object stores are read with a thread pool."""
    if all(storage.is_local(s.output_path) for s in plan.steps):
        return {s: st.read_status(s.output_path) for s in plan.steps}
    with ThreadPoolExecutor(16) as pool:
        return dict(zip(plan.steps, pool.map(lambda s: st.read_status(s.output_path), plan.steps)))


def select_steps(
    plan: Plan, statuses: dict[PlannedStep, dict | None], run_only: list[str] | None
) -> list[PlannedStep]:
    """Steps to run, dependencies first: all unfinished steps, or with ``run_only`` the steps whose
    name matches one of the regexes plus their unfinished (transitive) dependencies."""
    unfinished = {s for s in plan.steps if st.current_status(statuses[s]) != StepStatus.SUCCESS}
    if not run_only:
        return [s for s in plan.steps if s in unfinished]
    patterns = [re.compile(p) for p in run_only]
    wanted: set[PlannedStep] = set()
    stack = [s for s in plan.steps if any(p.search(s.name) for p in patterns)]
    if not stack:
        names = sorted({s.name for s in plan.steps})
        raise ExecutorError(f"--run_only {run_only} matches no step; step names: {names}")
    while stack:
        s = stack.pop()
        if s in wanted:
            continue
        wanted.add(s)
        stack.extend(d for d in s.dependencies + s.nonblocking_dependencies if d in unfinished)
    return [s for s in plan.steps if s in wanted and s in unfinished]


def step_info(ps: PlannedStep, config: Any, holder: str) -> dict[str, Any]:
    deps = ps.dependencies + ps.nonblocking_dependencies
    return {
        "name": ps.name,
        "description": ps.step.description,
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


def _execute_step(fn: Any, config: Any, output_path: str, inputs: tuple[tuple[str, str], ...] = ()) -> None:
    """Body of a step's Ray task; ``inputs``: (name, output path) of each blocking dependency."""
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

        def run_step(config: Any, output_path: str, inputs: tuple[tuple[str, str], ...]) -> float:
            started = time.time()
            _execute_step(fn, config, output_path, inputs)
            return started  # when the body began: the step may have waited in Ray's queue before

        entry = _REMOTE_BODIES[id(fn)] = (fn, ray.remote(run_step))
    return entry[1]


def blocking_inputs(ps: PlannedStep) -> tuple[tuple[str, str], ...]:
    """(name, output path) of each dependency ``ps`` must not start before (see :func:`check_inputs_succeeded`)."""
    return tuple((d.name, d.output_path) for d in ps.dependencies)


def _ray_options(ps: PlannedStep) -> dict[str, Any]:
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


# ----------------------------------------------------------------------------------------------- #
# the run loop                                                                                     #
# ----------------------------------------------------------------------------------------------- #


class _Runner:
    def __init__(self, plan: Plan, todo: list[PlannedStep], statuses: dict, opts: RunOptions):
        self.plan, self.todo, self.statuses, self.opts = plan, todo, statuses, opts
        self.holder = leases.new_holder_id()
        todo_set = set(todo)
        self.dependents = plan.dependents()
        self.order = {s: i for i, s in enumerate(plan.steps)}
        # blocking dependencies (in todo) without their final SUCCESS yet: a step is ready to submit
        # when this reaches 0 (a dependency retried after a failure keeps it above 0 meanwhile)
        self.remaining = {s: sum(1 for d in s.dependencies if d in todo_set) for s in todo}
        self.ready = collections.deque(s for s in todo if self.remaining[s] == 0)
        self.waiting: dict[PlannedStep, float] = {}
        self.running: dict[Any, PlannedStep] = {}
        self.refs: dict[PlannedStep, Any] = {}
        self.held: dict[PlannedStep, leases.Lease] = {}
        self.lost: set[PlannedStep] = set()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.outcome: dict[str, str] = {}
        self.errors: dict[str, str] = {}
        self.info: dict[PlannedStep, dict] = {}
        self.configs: dict[PlannedStep, Any] = {}
        self.initial_events = {s: len((statuses.get(s) or {}).get("events", [])) for s in todo}
        self.bar = None
        self._resources: dict[str, float] | None = None
        self.signals: StopSignals | None = None
        self.infra_failures: dict[PlannedStep, int] = collections.Counter()
        self.resubmit_at: dict[PlannedStep, float] = {}
        """Steps waiting out the backoff before their next attempt after an infrastructure failure."""
        self.retry_configs: dict[PlannedStep, Any] = {}
        self._pool_waits_at, self._pool_waits_n = 0.0, 0
        self.refused: set[PlannedStep] = set()
        """Steps whose task refused an input that was not SUCCESS when it started (DEP_FAILED)."""
        self.stop_notes: dict[str, str] = {}
        """Output path -> what a step with a grace period did when the run was stopped."""

    # -- heartbeat -------------------------------------------------------------------------------
    def _heartbeat(self) -> None:
        interval = max(0.05, self.opts.lease_ttl / 4)
        while not self.stop.wait(interval):
            with self.lock:
                held = list(self.held.items())
            for s, lease in held:
                try:
                    with storage.sparing_reserve():  # a full disk's space is for the failure's record
                        new = leases.renew(s.output_path, lease, self.opts.lease_ttl)
                except leases.LeaseReleased:  # we finished or stopped the step meanwhile
                    with self.lock:
                        if self.held.get(s) == lease:
                            del self.held[s]
                    continue
                except leases.LeaseLost as e:
                    with self.lock:
                        if self.held.get(s) != lease:  # the loop committed or stopped it meanwhile
                            continue
                        del self.held[s]
                        self.lost.add(s)
                        self.errors[s.output_path] = f"lease lost while running, step stopped: {e}"
                    logger.error("step %s: %s; stopping it", s.name, e)
                    continue
                except Exception as e:  # transient store error: try again next beat
                    logger.warning("step %s: lease renewal failed (%s); will retry", s.name, e)
                    continue
                with self.lock:
                    if s in self.held:
                        self.held[s] = new

    # -- transitions -----------------------------------------------------------------------------
    def _finish(self, s: PlannedStep, outcome: str) -> None:
        self.outcome[s.output_path] = outcome
        if self.bar is not None:
            self.bar.update(1)
        if outcome in ("succeeded", "reused"):
            self._upstream_succeeded(s)
        elif outcome in ("failed", "dep_failed", "lost"):
            self._fail_dependents(s)

    def _upstream_succeeded(self, s: PlannedStep) -> None:
        """``s``'s SUCCESS is committed (by us or another driver): dependents waiting only for it
        become ready. Never earlier: a step that is retried has not succeeded yet."""
        for d in self.dependents[s]:
            if d in self.remaining and s in d.dependencies:
                self.remaining[d] -= 1
                if self.remaining[d] == 0:
                    self.ready.append(d)

    def _fail_dependents(self, s: PlannedStep) -> None:
        for d in self.dependents[s]:
            if d not in self.remaining or d.output_path in self.outcome or s not in d.dependencies:
                continue
            self.waiting.pop(d, None)
            with self.lock:
                lease = self.held.pop(d, None)
            submitted = lease is not None
            lease = lease or leases.try_acquire(d.output_path, self.holder, self.opts.lease_ttl)
            if lease is not None:
                try:  # a step we never submitted did not start: our lease adds no attempt
                    record = st.with_attempts(st.read_status(d.output_path, attempts=False), lease, own=submitted)
                    if st.current_status(record) != StepStatus.SUCCESS:
                        st.write_status(
                            d.output_path, StepStatus.DEP_FAILED, lease=lease,
                            message=f"dependency {s.name} ({s.output_path}) did not succeed", previous=record,
                        )
                finally:
                    leases.release(d.output_path, lease)
            self.errors[d.output_path] = f"not run: dependency {s.name} did not succeed"
            self._finish(d, "dep_failed")

    @staticmethod
    def _cancel(ref: Any) -> None:
        import ray  # Ray only once steps run: planning and review import this module

        try:
            ray.cancel(ref, force=True)
        except Exception:  # already finished or the cluster is going away: nothing to stop
            pass

    def _start(self, s: PlannedStep) -> None:
        if s.output_path in self.outcome:  # an upstream failed after s became ready
            return
        problem = None
        if s not in self.info:
            try:
                config = resolve_config(s, self.plan)
                self.info[s] = step_info(s, config, self.holder)
                self.configs[s] = config
            except Exception as e:  # recorded as the step's failure once we hold its lease
                problem = (f"{type(e).__name__}: {e}", traceback.format_exc())
        # the lease carries the info: starting the step is this one write (the step reads RUNNING)
        lease = leases.try_acquire(s.output_path, self.holder, self.opts.lease_ttl, info=self.info.get(s))
        if lease is None:
            self.waiting[s] = time.monotonic()
            return
        with self.lock:
            self.held[s] = lease
        try:
            record = st.read_status(s.output_path, attempts=False)  # what happened before our attempt
            status = st.current_status(record)
            if status == StepStatus.SUCCESS:  # another executor finished it meanwhile
                self._release(s)
                self._finish(s, "reused")
                return
            if status == StepStatus.FAILED and len(record["events"]) > self.initial_events[s]:
                self._release(s)
                self.errors[s.output_path] = "failed in a concurrent executor; see marin show"
                self._finish(s, "failed")
                return
            if problem is not None:
                self._record_failure(s, *problem)
                return
            config = self.retry_configs[s] = self.configs.pop(s)
            options = _ray_options(s)
            missing = infeasible(options, self._cluster_resources())
            if missing:
                msg = (f"step {s.name} asks for {missing}, which no node of the Ray cluster offers "
                       f"(cluster: {self._cluster_resources()})")
                if not (self.opts.address or os.environ.get("RAY_ADDRESS")):
                    raise RuntimeError(msg + "; the local cluster cannot grow: run on a cluster that has it")
                self._print(f"warning: {msg}; waiting for the autoscaler")
            if s.step.stop_grace_s > 0:  # a driver killed while it waited for this step left its request
                clear_stop_request(s.output_path)
            ref = remote_body(s.step.fn).options(**options).remote(config, s.output_path, blocking_inputs(s))
        except Exception as e:  # bookkeeping or submission failed: the step failed
            self._record_failure(s, f"{type(e).__name__}: {e}", traceback.format_exc())
            return
        self.running[ref] = s
        self.refs[s] = ref

    def _submission_window(self) -> int:
        """How many steps may be submitted to Ray (and hold a lease) at once.

        Enough to keep every CPU of the cluster busy while the driver collects results (four per
        CPU, at least 32), and no more: a step that only waits in Ray's queue would hold its lease
        and be renewed by every heartbeat, and could not be taken by another executor meanwhile."""
        window = max(32, 4 * int(self._cluster_resources().get("CPU", 0)))
        return min(window, self.opts.max_concurrent) if self.opts.max_concurrent else window

    def _cluster_resources(self) -> dict[str, float]:
        if self._resources is None:
            import ray  # Ray only once steps run: planning and review import this module

            self._resources = dict(ray.cluster_resources())
        return self._resources

    def _release(self, s: PlannedStep) -> leases.Lease | None:
        with self.lock:
            lease = self.held.pop(s, None)
        if lease is not None:
            leases.release(s.output_path, lease)
        return lease

    def _record_failure(self, s: PlannedStep, error: str, tb: str) -> None:
        error, tb = mask_text(error), mask_text(tb)  # an error message may quote the config
        info = {**(self.info.get(s) or {"name": s.name, "output_path": s.output_path}), "error": error, "traceback": tb}
        with self.lock:
            lease = self.held.get(s)
        try:
            if lease is not None:  # else the lease was taken over: the step is no longer ours to write
                st.write_status(s.output_path, StepStatus.FAILED, lease=lease, message=error, info=info)
        except Exception as e:  # noqa: BLE001 - the cause is printed below all the same
            # said on the driver, not only logged: the record was the one place that would have told
            self._print(f"step {s.name}: could not record the failure in {s.output_path}: "
                        f"{describe_write_error(e, s)}")
        try:
            self._release(s)
        except Exception as e:  # noqa: BLE001 - the lease expires by itself; the cause matters more
            logger.error("step %s: could not release its lease: %s", s.name, describe_write_error(e, s))
        self.errors[s.output_path] = f"{error}\n{tb}"
        self._print(f"FAILED {s.name} ({s.output_path}): {error}")
        self._finish(s, "failed")

    def _on_done(self, ref: Any) -> None:
        import ray  # Ray only once steps run: planning and review import this module

        s = self.running.pop(ref, None)
        if s is None:  # dropped meanwhile: an upstream processed in the same batch failed
            return
        self.refs.pop(s, None)
        try:
            started = ray.get(ref)
        except Exception as e:
            if s in self.lost:
                self._finish(s, "lost")
                return
            # the step's own exception, not Ray's wrapper of it (which is an instance too)
            refused = next((c for c in error_chain(e) if type(c) is InputNotSucceeded), None)
            if refused is not None:
                self._record_refused_input(s, str(refused))
                return
            error, tb = describe_failure(e)
            if is_infrastructure_failure(e) and self.infra_failures[s] < self.infra_limit(s):
                self._retry_later(s, error)
                return
            if self.infra_failures[s]:
                error += f" (after {self.infra_failures[s]} retried infrastructure failure(s))"
            if (full := disk_full_error(e)) is not None:
                error = f"{disk_full_message(full, s)} ({error})"
            self._record_failure(s, error, tb)
            return
        with self.lock:  # from here on the heartbeat leaves this lease alone
            lease = self.held.pop(s, None)
        try:
            if lease is None:
                raise leases.LeaseLost("lease lost during the run")
            with leases.fenced(s.output_path, lease):  # still ours? then commit, SUCCESS last
                st.write_status(s.output_path, StepStatus.SUCCESS, lease=lease, started=started,
                                consume=leases.lease_path(s.output_path))  # the lease goes with it
        except leases.LeaseLost as e:
            self.errors[s.output_path] = f"lease lost before SUCCESS could be written: {e}"
            self._finish(s, "lost")
            return
        except Exception as e:  # store unreachable while committing: the step is not finished
            with self.lock:
                self.held[s] = lease
            self._record_failure(s, f"could not record success: {describe_write_error(e, s)}", traceback.format_exc())
            return
        self._finish(s, "succeeded")

    def _record_refused_input(self, s: PlannedStep, why: str) -> None:
        """``s``'s task refused to start on an input that was not SUCCESS (see
        :func:`check_inputs_succeeded`): DEP_FAILED with the reason, not a failure of ``s`` itself,
        so the next run starts it again without --retry_failed."""
        with self.lock:
            lease = self.held.get(s)
        try:
            if lease is not None:
                st.write_status(s.output_path, StepStatus.DEP_FAILED, lease=lease, message=why)
        except Exception as e:  # noqa: BLE001 - said on the driver below all the same
            self._print(f"step {s.name}: could not record why it did not start: {describe_write_error(e, s)}")
        self._release(s)
        self.errors[s.output_path] = f"not run: {why}"
        self.refused.add(s)
        self._print(f"NOT STARTED {s.name}: {why}")
        self._finish(s, "dep_failed")

    def infra_limit(self, s: PlannedStep) -> int:
        """How often ``s`` is resubmitted after infrastructure failures: ``--infra_retries`` for every
        step when given, else the step's own (a device pool's steps retry, the rest do not)."""
        if self.opts.infra_retries is not None:
            return self.opts.infra_retries
        return s.step.infra_retries or 0

    def _retry_later(self, s: PlannedStep, error: str) -> None:
        """Record an infrastructure failure as an attempt and resubmit the step after a backoff.

        The step keeps its lease (it stays RUNNING for every reader, with the attempt in its events)
        and resumes from whatever it committed: a training step from its last checkpoint."""
        self.infra_failures[s] += 1
        n = self.infra_failures[s]
        delay = min(60.0, 2.0 * 2 ** (n - 1))
        message = (f"infrastructure failure ({mask_text(error)}); attempt {n + 1} of {self.infra_limit(s) + 1} "
                   f"starts in {delay:.0f}s from what the step committed")
        with self.lock:
            lease = self.held.get(s)
        if lease is None:  # taken over meanwhile: not ours to retry
            self._finish(s, "lost")
            return
        try:
            st.write_status(s.output_path, StepStatus.RUNNING, lease=lease, message=message)
        except Exception as e:  # noqa: BLE001 - the record is the store's; the retry goes on without it
            logger.error("step %s: could not record the retry: %s", s.name, e)
        self._print(f"RETRY {s.name}: {message}")
        self.resubmit_at[s] = time.monotonic() + delay

    def _resubmit_due(self) -> None:
        now = time.monotonic()
        for s, at in list(self.resubmit_at.items()):
            if at > now:
                continue
            del self.resubmit_at[s]
            with self.lock:
                held = s in self.held
            if not held:  # the lease was lost while waiting
                self._finish(s, "lost")
                continue
            try:
                ref = remote_body(s.step.fn).options(**_ray_options(s)).remote(self.retry_configs[s], s.output_path,
                                                                               blocking_inputs(s))
            except Exception as e:  # noqa: BLE001 - submission failed: the step failed
                self._record_failure(s, f"{type(e).__name__}: {e}", traceback.format_exc())
                continue
            self.running[ref] = s
            self.refs[s] = ref

    def interrupt(self, signum: int = signal.SIGINT) -> None:
        """A stop signal: stop every step this driver holds, mark it INTERRUPTED, release its lease.

        A running step with a grace period (``ExecutorStep.stop_grace_s``, a training step's
        ``preemption_grace_s``) is first asked to save and stop by itself (:meth:`_let_steps_stop`);
        the others are cancelled at once. Stop signals are ignored meanwhile so a second signal (the
        scheduler's repeated SIGTERM) cannot leave a step RUNNING with a dead holder (the next run
        would then wait for the holder's lease to expire); only a second Ctrl-C cuts the grace short."""
        in_main = threading.current_thread() is threading.main_thread()
        insist = threading.Event()

        def again(sig: int, frame: Any) -> None:
            if sig == signal.SIGINT:
                insist.set()

        previous = {sig: signal.signal(sig, again) for sig in STOP_SIGNALS} if in_main else {}
        message = f"the run was stopped ({stop_reason(signum)})"
        try:
            notes = self._let_steps_stop(signum, insist)
            self._interrupt(message, notes)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _let_steps_stop(self, signum: int, insist: threading.Event) -> dict[PlannedStep, str]:
        """Ask each running step with a grace period to save and stop (a stop request in its
        directory), and wait for it until that grace period is up, less :data:`STOP_RESERVE_S` the
        step leaves the driver; a step that finished meanwhile is committed as usual. Returns what
        each of them did, for its INTERRUPTED record."""
        import ray  # Ray only once steps run: planning and review import this module

        graceful = {ref: s for ref, s in self.running.items() if s.step.stop_grace_s > 0}
        if not graceful:
            return {}
        began = time.monotonic()
        for ref in self.running:
            if ref not in graceful:  # nothing to save: stopped at once, as without a grace period
                self._cancel(ref)
        with retry.capped(INTERRUPT_RETRY_S):
            for s in graceful.values():
                try:
                    request_stop(s.output_path, signum, s.step.stop_grace_s - STOP_RESERVE_S)
                except Exception as e:  # noqa: BLE001 - the store is down: the step is cancelled at its deadline
                    logger.error("step %s: could not ask it to stop: %s", s.name, e)
        deadline = {ref: began + s.step.stop_grace_s for ref, s in graceful.items()}
        longest = max(s.step.stop_grace_s for s in graceful.values())
        self._print(f"stopping ({stop_reason(signum)}): {len(graceful)} step(s) may take up to {longest:.0f}s to "
                    "save their work and stop" + ("; Ctrl-C again stops them at once" if signum == signal.SIGINT
                                                  else ""))
        notes: dict[PlannedStep, str] = {}
        pending = list(graceful)
        while pending and not insist.is_set():
            now = time.monotonic()
            for ref in [r for r in pending if deadline[r] <= now]:
                pending.remove(ref)
                s = graceful[ref]
                notes[s] = f"it did not stop within its {s.step.stop_grace_s:.0f}s grace period and was cancelled"
            if not pending:
                break
            timeout = min(0.5, min(deadline[r] for r in pending) - now)  # short: a second Ctrl-C is seen
            done, _ = ray.wait(pending, num_returns=len(pending), timeout=max(0.0, timeout))
            for ref in done:
                pending.remove(ref)
                s = graceful[ref]
                try:
                    ray.get(ref)
                except Exception as e:  # noqa: BLE001 - the step stopped (or failed) in its grace period
                    # ended: never cancelled (Ray aborts when a force-cancel races the task's reply)
                    self.running.pop(ref, None)
                    cause = getattr(e, "cause", None)
                    notes[s] = (str(cause).splitlines()[0] if isinstance(cause, StopRequested)
                                else f"it ended with {describe_failure(e)[0]}")
                else:
                    self._on_done(ref)  # it finished in its grace period: SUCCESS, as any other
        for ref in pending:
            notes[graceful[ref]] = "it was cancelled by a second Ctrl-C"
        return notes

    def _interrupt(self, message: str, notes: dict[PlannedStep, str] | None = None) -> None:
        notes = notes or {}
        with retry.capped(INTERRUPT_RETRY_S):  # the person (or the scheduler's grace period) is waiting
            import ray  # Ray only once steps run: planning and review import this module

            for ref in list(self.running):
                try:
                    ray.cancel(ref, force=True)
                except Exception:  # already finished or the cluster is going away: nothing to stop
                    pass
            with self.lock:
                held = list(self.held.items())
            for s, lease in held:
                note = notes.get(s)
                try:
                    record = st.read_status(s.output_path)
                    if st.current_status(record) == StepStatus.RUNNING:
                        st.write_status(s.output_path, StepStatus.INTERRUPTED, lease=lease,
                                        message=f"{message}; {note}" if note else message, previous=record)
                    if s.step.stop_grace_s > 0:
                        clear_stop_request(s.output_path)
                except Exception as e:  # pragma: no cover - store unreachable
                    logger.error("step %s: could not record the interruption: %s", s.name, e)
                self._release(s)
                self.outcome[s.output_path] = "interrupted"
                if note:
                    self.stop_notes[s.output_path] = note

    def _check_waiting(self) -> None:
        now = time.monotonic()
        for s, since in list(self.waiting.items()):
            if now - since < self.opts.poll_interval:
                continue
            self.waiting[s] = now
            lease = leases.read_lease(s.output_path)
            if lease is not None and not leases.is_stale(lease, time.time(), socket.gethostname()):
                continue  # a live executor is on it
            del self.waiting[s]
            self._start(s)  # may find SUCCESS (reuse), FAILED (fail), or take over

    def _pool_waits(self) -> int:
        """How many running steps wait for a pool reservation the cluster can hold but others hold now
        (their placement groups, named after the step, are pending); looked up every few seconds."""
        now = time.monotonic()
        if now - self._pool_waits_at < POOL_WAITS_EVERY_S or not self.running:
            return self._pool_waits_n if self.running else 0
        self._pool_waits_at = now
        try:
            from ray.util.placement_group import placement_group_table  # Ray only once steps run (see above)

            pending = [t["name"] for t in placement_group_table().values() if t["state"] == "PENDING"]
        except Exception:  # noqa: BLE001 - a count for the progress bar; the run does not depend on it
            return self._pool_waits_n
        owners = {placement_owner(s.output_path) for s in self.running.values()}
        self._pool_waits_n = len({o for o in owners if any(name.startswith(o) for name in pending)})
        return self._pool_waits_n

    def _print(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr)

    def loop(self) -> None:
        import ray  # Ray only once steps run: planning and review import this module

        self.bar = tqdm(
            total=len(self.todo), desc="steps", unit="step", file=sys.stderr, disable=not self.opts.progress,
            mininterval=0.5, dynamic_ncols=True,
        )
        window = self._submission_window()
        beat = threading.Thread(target=self._heartbeat, name="marin-lease-heartbeat", daemon=True)
        beat.start()
        try:
            while self.ready or self.running or self.waiting or self.resubmit_at:
                while self.ready and len(self.running) < window:
                    self._start(self.ready.popleft())
                if self.resubmit_at:
                    self._resubmit_due()
                with self.lock:
                    lost = [s for s in self.lost if s in self.refs]
                for s in lost:
                    ray.cancel(self.refs[s], force=True)
                if self.waiting:
                    self._check_waiting()
                if self.running:
                    timeout = self.opts.poll_interval if (self.waiting or lost) else 1.0
                    done, _ = ray.wait(list(self.running), num_returns=1, timeout=timeout)
                    if done:  # collect everything else that is already finished too
                        more, _ = ray.wait(list(self.running), num_returns=len(self.running), timeout=0)
                        # upstreams first: a dependent's result is judged after its upstream's
                        for ref in sorted(set(done + more), key=lambda r: self.order[self.running[r]]):
                            self._on_done(ref)
                elif (self.waiting or self.resubmit_at) and not self.ready:
                    time.sleep(min(self.opts.poll_interval, 0.2))
                self.bar.set_postfix(running=len(self.running), waiting=len(self.waiting) + self._pool_waits(),
                                     refresh=False)
        except KeyboardInterrupt as e:
            self.interrupt(signal_of(e, self.signals))
            raise
        finally:
            self.stop.set()
            for s in list(self.held):
                self._release(s)
            self.bar.close()


def run_plan(plan: Plan, opts: RunOptions) -> RunResult:
    """Run every unfinished step of ``plan`` (see module docstring); raise ExecutorError on failure."""
    try:
        statuses = read_statuses(plan)
    except Exception as e:  # unreachable store, missing credentials, ...
        problem = mask_text(unreadable_store_message(f"step status under {plan.prefix}", e))
        if not opts.dry_run:
            raise ExecutorError(f"{problem}\n{STORE_ADVICE[0].upper()}{STORE_ADVICE[1:]}.") from e
        print(f"warning: {problem}; showing the plan as if no step had run", file=sys.stderr)
        statuses = {s: None for s in plan.steps}
    unreadable = [s for s in plan.steps if st.current_status(statuses[s]) == StepStatus.UNREADABLE]
    if unreadable and not opts.dry_run:
        if not opts.repair_records:
            raise UnreadableRecordError(unreadable_message(unreadable, statuses))
        statuses.update(repair_records(plan, unreadable, statuses, opts))
    todo = select_steps(plan, statuses, opts.run_only)
    outcome: dict[str, str] = {}
    for s in plan.steps:
        if st.current_status(statuses[s]) == StepStatus.SUCCESS:
            outcome[s.output_path] = "cached"
        elif s not in todo:
            outcome[s.output_path] = "not_selected"

    failed_before = [s for s in todo if st.current_status(statuses[s]) == StepStatus.FAILED]
    if opts.retry_failed:
        patterns = [re.compile(p) for p in opts.retry_failed]
        named = [s for s in failed_before if any(p.fullmatch(s.name) or p.search(s.output_path) for p in patterns)]
        if not named:
            names = ", ".join(s.name for s in failed_before) or "none"
            raise ExecutorError(f"--retry_failed {' '.join(opts.retry_failed)} names no failed step of this "
                                f"experiment (failed steps: {names})")
        failed_before = [s for s in failed_before if s not in named]
    if failed_before and not opts.force_run_failed and not opts.dry_run:
        names = "\n".join(f"  {s.name} ({s.output_path})" for s in failed_before)
        raise PreviouslyFailedError(
            f"{len(failed_before)} step(s) failed in an earlier run:\n{names}\n"
            "See why with `marin show <path>`, fix the cause, then rerun with --retry_failed STEP (that step) "
            "or --force_run_failed true (every failed step); failed steps are not retried by default so a "
            "broken step cannot burn compute silently."
        )

    if opts.dry_run:
        for s in todo:
            outcome[s.output_path] = "dry_run"
        print_dry_run(plan, statuses, todo)
        return RunResult(plan, outcome, None)

    problem = storage.writable_problem(f"{plan.prefix}/experiments")
    if not todo:  # nothing will be written but the record: a read-only prefix is fine
        print(f"Nothing to run: all {len(plan.steps)} steps already succeeded under {plan.prefix}", file=sys.stderr)
        if problem:
            print(f"(the experiment record was not updated: cannot write under {plan.prefix}: {problem})",
                  file=sys.stderr)
            return RunResult(plan, outcome, None)
        return RunResult(plan, outcome, write_experiment_record(plan, opts, outcome))
    if problem:
        raise ExecutorError(
            f"cannot write under the prefix {plan.prefix} ({problem}); choose a writable --prefix or $MARIN_PREFIX"
        )

    storage.makedirs(plan.prefix)
    runner = _Runner(plan, todo, statuses, opts)
    started = False
    # space held back on a local prefix, so a step that fills the disk still gets its failure recorded
    with storage.space_reserved(plan.prefix), StopSignals() as signals:
        runner.signals = signals
        try:
            started = ensure_ray(opts.address)
            signals.install()  # ray.init replaced our SIGTERM handler with its own
            record = write_experiment_record(plan, opts, outcome)
            runner.loop()
        except KeyboardInterrupt as e:
            with signals.deferred("recording the stop"):
                outcome.update(runner.outcome)
                raise _interrupted(plan, opts, outcome, runner, signal_of(e, signals)) from None
        finally:
            # a cluster we started ends with the run, agents included, signal or not
            with signals.deferred("stopping the Ray cluster"):
                if started:
                    shutdown_local_ray()
                    signals.install()  # ray.shutdown may have put SIGTERM back to its default action
        with signals.deferred("recording the run"):
            outcome.update(runner.outcome)
            try:
                record = write_experiment_record(plan, opts, outcome)
            except OSError as e:
                if disk_full_error(e) is None:
                    raise
                record = None  # the steps' own records are what the next run reads
                print(f"(the experiment record was not updated: disk full: {e.strerror} under {plan.prefix}; "
                      "free space and rerun)", file=sys.stderr)
            if signals.received is not None:  # every step had ended; the stop still ends the process as asked
                raise _interrupted(plan, opts, outcome, runner, signals.received, during=signals.received_during,
                                   record=record)
    result = RunResult(plan, outcome, record, runner.errors)
    bad = [s for s in todo if outcome.get(s.output_path) in ("failed", "lost") or s in runner.refused]
    counts = collections.Counter(outcome.values())
    print(
        "Steps: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + f"  (record: {record})",
        file=sys.stderr,
    )
    if bad:
        lines = [f"{len(bad)} step(s) failed:"]
        for s in bad:
            lines.append(f"--- step {s.name} ({s.output_path}) ---\n{runner.errors.get(s.output_path, '')}")
        dep = [s.name for s in todo if outcome.get(s.output_path) == "dep_failed" and s not in runner.refused]
        if dep:
            lines.append(f"not run because a dependency failed: {', '.join(dep)}")
        err = ExecutorError("\n".join(lines))
        err.result = result  # type: ignore[attr-defined]
        raise err
    return result


def unreadable_message(steps: list[PlannedStep], statuses: dict[PlannedStep, dict | None]) -> str:
    """Why the run refuses to start over unreadable records, and what ``--repair_records`` would do."""
    lines = [f"{len(steps)} step(s) have a status record that cannot be read; their outputs may be complete, "
             "so they are neither reused nor recomputed:"]
    for s in steps:
        status, why = st.rebuild_plan(statuses[s])
        lines.append(f"  {s.name} ({s.output_path}): {statuses[s]['unreadable']}\n"
                     f"      --repair_records true would rebuild it as {status.value}: {why}")
    lines.append("Look at the step directories (marin show PATH), then rerun with --repair_records true "
                 "(the damaged records are kept as .executor_status.unreadable).")
    return "\n".join(lines)


def repair_records(plan: Plan, steps: list[PlannedStep], statuses: dict[PlannedStep, dict | None],
                   opts: RunOptions) -> dict[PlannedStep, dict]:
    """Rebuild each step's unreadable record under its lease (see :func:`status.rebuild_record`)."""
    holder = leases.new_holder_id()
    out = {}
    for s in steps:
        lease = leases.try_acquire(s.output_path, holder, opts.lease_ttl)
        if lease is None:
            raise ExecutorError(f"cannot repair the record of {s.name} ({s.output_path}): a live executor holds "
                                "its lease; wait for it to finish or stop it, then rerun")
        try:
            info = step_info(s, resolve_config(s, plan), holder)
            out[s] = st.rebuild_record(s.output_path, statuses[s], lease=lease, info=info)
        finally:
            leases.release(s.output_path, lease)  # a rebuilt SUCCESS removed it already: nothing to release
        event = out[s]["events"][-1]
        print(f"rebuilt the record of {s.name} ({s.output_path}) as {out[s]['status']}: "
              f"{event['message'].rsplit('): ', 1)[-1]}", file=sys.stderr)
    return out


def _interrupted(plan: Plan, opts: RunOptions, outcome: dict[str, str], runner: "_Runner",
                 signum: int = signal.SIGINT, *, during: str | None = None,
                 record: str | None = None) -> ExecutorInterrupted:
    """The message (and record) for a run stopped by a signal: what stopped, what is kept, how to resume.

    ``during``: the signal came after every step had ended, while the driver was ``during`` (stopping
    the Ray cluster, writing the record), whose ``record`` is then written already."""
    if record is None:
        try:
            record = write_experiment_record(plan, opts, outcome)
        except Exception:  # the record is a convenience; the statuses are what the next run reads
            record = None
    stopped = [s for s in plan.steps if outcome.get(s.output_path) == "interrupted"]
    failed = [s for s in plan.steps if outcome.get(s.output_path) in ("failed", "lost")]
    done = sum(1 for v in outcome.values() if v in ("succeeded", "reused"))
    head = "interrupted (Ctrl-C)" if signum == signal.SIGINT else f"stopped by {stop_reason(signum)}"
    lines = [f"{head} while {during}, after every step had ended." if during else f"{head}."]
    if stopped:
        lines.append(f"{len(stopped)} running step(s) stopped and marked INTERRUPTED, their leases released:")
        for s in stopped:
            note = runner.stop_notes.get(s.output_path)
            lines.append(f"  {s.name} ({s.output_path})" + (f"\n      {note}" if note else ""))
    elif not during:
        lines.append("No step was running.")
    lines.append(f"{done} step(s) finished in this run and are kept" + (f" (record: {record})." if record else "."))
    if failed:
        lines.append(f"{len(failed)} step(s) failed (see why with `marin show PATH`; rerun one with "
                     "--retry_failed STEP):")
        for s in failed:
            error = (runner.errors.get(s.output_path) or "").split("\n", 1)[0]
            lines.append(f"  {s.name} ({s.output_path}): {error}")
    command = shlex.join(mask_argv([os.path.basename(sys.executable), *sys.argv]))
    if stopped or not during:
        lines.append(f"To resume, run the same command again: {command}")
    err = ExecutorInterrupted("\n".join(lines))
    err.signum = signum
    err.result = RunResult(plan, outcome, record, runner.errors)  # type: ignore[attr-defined]
    return err


def print_dry_run(plan: Plan, statuses: dict, todo: list[PlannedStep]) -> None:
    todo_set = set(todo)
    print(f"Dry run under {plan.prefix}: {len(todo)} of {len(plan.steps)} steps would run")
    for s in plan.steps:
        status = st.current_status(statuses[s])
        mark = "run " if s in todo_set else "skip"
        if status == StepStatus.UNREADABLE:
            rebuilt, why = st.rebuild_plan(statuses[s])
            print(f"  [stop] {s.name}-{s.hash}  (UNREADABLE)  {s.output_path}\n         {statuses[s]['unreadable']}; "
                  f"a run refuses it; --repair_records true rebuilds it as {rebuilt.value} ({why})")
            continue
        print(f"  [{mark}] {s.name}-{s.hash}  ({status.value if status else 'new'})  {s.output_path}")
        if statuses[s] is not None:
            info = st.read_info(s.output_path, statuses[s])
            msg = drift((info or {}).get("code_fingerprint"), code_fingerprint(s.step.fn))
            if msg:
                print(f"         warning: {msg} (the hash is unchanged; outputs are kept)")
