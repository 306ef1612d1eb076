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
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any

from tqdm import tqdm

from marin.execution import status as st
from marin.execution import storage
from marin.execution.cluster import (
    build_serialization_context,
    ensure_ray,
    import_ray_for_the_driver,
    shutdown_local_ray,
)
from marin.execution.errors import ExecutorError, ExecutorInterrupted
from marin.execution.experiment_record import record_steps, write_experiment_record
from marin.execution.failures import InputNotSucceeded, disk_full_error, error_chain
from marin.execution.infra_retry import InfraRetries
from marin.execution.jsonable import mask_log_records, mask_text
from marin.execution.lease import LeaseLost, fenced, is_stale, lease_path, read_lease, release, try_acquire
from marin.execution.lease_keeper import LeaseKeeper
from marin.execution.options import RunOptions
from marin.execution.outcome import Outcome, RunResult
from marin.execution.plan import Plan, PlannedStep, resolve_config
from marin.execution.selection import print_dry_run, run_statuses, selected
from marin.execution.signals import RunStopped, StopSignals, clear_stop_request, signal_of
from marin.execution.status import StepStatus
from marin.execution.stop import Stopper, interrupted_error
from marin.execution.tasks import (
    PoolWaits,
    describe_failure,
    describe_write_error,
    disk_full_message,
    infeasible,
    ray_options,
    step_info,
    submit,
    task_args,
)

logger = logging.getLogger("marin.execution")

# ----------------------------------------------------------------------------------------------- #
# the run loop                                                                                     #
# ----------------------------------------------------------------------------------------------- #


class _Runner:
    """One run's scheduler: submits ready steps within the window, commits what finishes, fails
    the dependents of what did not, resubmits infrastructure failures after a backoff, and waits
    for steps another live driver holds."""

    def __init__(self, plan: Plan, todo: list[PlannedStep], statuses: dict, opts: RunOptions):
        self.plan, self.todo, self.statuses, self.opts = plan, todo, statuses, opts
        self.keeper = LeaseKeeper(opts.lease_ttl)
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
        self.outcome: dict[str, Outcome] = {}
        self.errors: dict[str, str] = {}
        self.info: dict[PlannedStep, dict] = {}
        self.args: dict[PlannedStep, bytes] = {}
        """Each prepared step's task arguments, pickled (:func:`tasks.task_args`); kept for its retries."""
        self.problems: dict[PlannedStep, tuple[str, str]] = {}
        """Steps whose config could not be resolved or pickled: (error, traceback), recorded as their
        failure once their lease is held."""
        self._stop_preparing = threading.Event()
        self.record_steps: list[dict] | None = None
        """The steps as this run's experiment records list them (:func:`record_steps`), computed once."""
        self.initial_events = {s: len((statuses.get(s) or {}).get("events", [])) for s in todo}
        self.bar = None
        self._resources: dict[str, float] | None = None
        self.signals: StopSignals | None = None
        self.retries = InfraRetries(opts.infra_retries)
        self.pool_waits = PoolWaits()
        self.refused: set[PlannedStep] = set()
        """Steps whose task refused an input that was not SUCCESS when it started (DEP_FAILED)."""
        self.stop_notes: dict[str, str] = {}
        """Output path -> what a step with a grace period did when the run was stopped."""

    # -- transitions -----------------------------------------------------------------------------
    def _finish(self, s: PlannedStep, outcome: Outcome) -> None:
        self.outcome[s.output_path] = outcome
        if outcome == Outcome.LOST and s in self.keeper.lost:
            self.errors.setdefault(s.output_path, self.keeper.lost[s])
        if self.bar is not None:
            self.bar.update(1)
        if outcome in (Outcome.SUCCEEDED, Outcome.REUSED):
            self._upstream_succeeded(s)
        elif outcome in (Outcome.FAILED, Outcome.DEP_FAILED, Outcome.LOST):
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
            lease = self.keeper.take(d)
            submitted = lease is not None
            lease = lease or try_acquire(d.output_path, self.keeper.holder, self.opts.lease_ttl)
            if lease is not None:
                try:  # a step we never submitted did not start: our lease adds no attempt
                    record = st.with_attempts(st.read_status(d.output_path, attempts=False), lease, own=submitted)
                    if st.current_status(record) != StepStatus.SUCCESS:
                        st.write_status(
                            d.output_path, StepStatus.DEP_FAILED, lease=lease,
                            message=f"dependency {s.name} ({s.output_path}) did not succeed", previous=record,
                        )
                finally:
                    release(d.output_path, lease)
            self.errors[d.output_path] = f"not run: dependency {s.name} did not succeed"
            self._finish(d, Outcome.DEP_FAILED)

    def _start(self, s: PlannedStep) -> None:
        if s.output_path in self.outcome:  # an upstream failed after s became ready
            return
        if s not in self.args and s not in self.problems:
            self._prepare(s)
        problem = self.problems.get(s)
        # the lease carries the info: starting the step is this one write (the step reads RUNNING)
        if self.keeper.acquire(s, info=self.info.get(s)) is None:
            self.waiting[s] = time.monotonic()
            return
        try:
            record = st.read_status(s.output_path, attempts=False)  # what happened before our attempt
            status = st.current_status(record)
            if status == StepStatus.SUCCESS:  # another executor finished it meanwhile
                self.keeper.release(s)
                self._finish(s, Outcome.REUSED)
                return
            if status == StepStatus.FAILED and len(record["events"]) > self.initial_events[s]:
                self.keeper.release(s)
                self.errors[s.output_path] = "failed in a concurrent executor; see marin show"
                self._finish(s, Outcome.FAILED)
                return
            if problem is not None:
                self._record_failure(s, *problem)
                return
            options = ray_options(s)
            missing = infeasible(options, self._cluster_resources())
            if missing:
                msg = (f"step {s.name} asks for {missing}, which no node of the Ray cluster offers "
                       f"(cluster: {self._cluster_resources()})")
                if not (self.opts.address or os.environ.get("RAY_ADDRESS")):
                    raise RuntimeError(msg + "; the local cluster cannot grow: run on a cluster that has it")
                self._print(f"warning: {msg}; waiting for the autoscaler")
            if s.step.stop_grace_s > 0:  # a driver killed while it waited for this step left its request
                clear_stop_request(s.output_path)
            ref = submit(s, self.args[s])
        except Exception as e:  # bookkeeping or submission failed: the step failed
            self._record_failure(s, f"{type(e).__name__}: {e}", traceback.format_exc())
            return
        self.running[ref] = s
        self.refs[s] = ref

    def prepare(self) -> None:
        """Resolve every selected step's config, its info and its task's arguments, dependencies
        first: what submitting a step needs, done while the Ray cluster starts (a thread of
        :func:`run_plan`) rather than in the loop, one step at a time."""
        self.record_steps = record_steps(self.plan)
        build_serialization_context()  # before the first pickling here: it registers Ray's reducers
        for s in self.todo:
            if self._stop_preparing.is_set():
                return
            self._prepare(s)

    def _prepare(self, s: PlannedStep) -> None:
        try:
            config = resolve_config(s, self.plan)
            self.info[s] = step_info(s, config, self.keeper.holder)
            self.args[s] = task_args(s, config)
        except Exception as e:  # recorded as the step's failure once we hold its lease
            self.problems[s] = (f"{type(e).__name__}: {e}", traceback.format_exc())

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

    def _record_failure(self, s: PlannedStep, error: str, tb: str) -> None:
        error, tb = mask_text(error), mask_text(tb)  # an error message may quote the config
        info = {**(self.info.get(s) or {"name": s.name, "output_path": s.output_path}), "error": error, "traceback": tb}
        lease = self.keeper.get(s)
        try:
            if lease is not None:  # else the lease was taken over: the step is no longer ours to write
                st.write_status(s.output_path, StepStatus.FAILED, lease=lease, message=error, info=info)
        except Exception as e:  # noqa: BLE001 - the cause is printed below all the same
            # said on the driver, not only logged: the record was the one place that would have told
            self._print(f"step {s.name}: could not record the failure in {s.output_path}: "
                        f"{describe_write_error(e, s)}")
        try:
            self.keeper.release(s)
        except Exception as e:  # noqa: BLE001 - the lease expires by itself; the cause matters more
            logger.error("step %s: could not release its lease: %s", s.name, describe_write_error(e, s))
        self.errors[s.output_path] = f"{error}\n{tb}"
        self._print(f"FAILED {s.name} ({s.output_path}): {error}")
        self._finish(s, Outcome.FAILED)

    def _on_done(self, ref: Any) -> None:
        import ray  # Ray only once steps run: planning and review import this module

        s = self.running.pop(ref, None)
        if s is None:  # dropped meanwhile: an upstream processed in the same batch failed
            return
        self.refs.pop(s, None)
        try:
            started = ray.get(ref)
        except Exception as e:
            if s in self.keeper.lost:
                self._finish(s, Outcome.LOST)
                return
            # the step's own exception, not Ray's wrapper of it (which is an instance too)
            refused = next((c for c in error_chain(e) if type(c) is InputNotSucceeded), None)
            if refused is not None:
                self._record_refused_input(s, str(refused))
                return
            error, tb = describe_failure(e)
            if self.retries.retries(s, e):
                self._retry_later(s, error)
                return
            error = self.retries.after(s, error)
            if (full := disk_full_error(e)) is not None:
                error = f"{disk_full_message(full, s)} ({error})"
            self._record_failure(s, error, tb)
            return
        lease = self.keeper.take(s)  # from here on the heartbeat leaves this lease alone
        try:
            if lease is None:
                raise LeaseLost("lease lost during the run")
            with fenced(s.output_path, lease):  # still ours? then commit, SUCCESS last
                st.write_status(s.output_path, StepStatus.SUCCESS, lease=lease, started=started,
                                consume=lease_path(s.output_path))  # the lease goes with it
        except LeaseLost as e:
            self.errors[s.output_path] = f"lease lost before SUCCESS could be written: {e}"
            self._finish(s, Outcome.LOST)
            return
        except Exception as e:  # store unreachable while committing: the step is not finished
            self.keeper.hold(s, lease)
            self._record_failure(s, f"could not record success: {describe_write_error(e, s)}", traceback.format_exc())
            return
        self._finish(s, Outcome.SUCCEEDED)

    def _record_refused_input(self, s: PlannedStep, why: str) -> None:
        """``s``'s task refused to start on an input that was not SUCCESS (see
        :func:`check_inputs_succeeded`): DEP_FAILED with the reason, not a failure of ``s`` itself,
        so the next run starts it again without --retry_failed."""
        lease = self.keeper.get(s)
        try:
            if lease is not None:
                st.write_status(s.output_path, StepStatus.DEP_FAILED, lease=lease, message=why)
        except Exception as e:  # noqa: BLE001 - said on the driver below all the same
            self._print(f"step {s.name}: could not record why it did not start: {describe_write_error(e, s)}")
        self.keeper.release(s)
        self.errors[s.output_path] = f"not run: {why}"
        self.refused.add(s)
        self._print(f"NOT STARTED {s.name}: {why}")
        self._finish(s, Outcome.DEP_FAILED)

    def _retry_later(self, s: PlannedStep, error: str) -> None:
        """Record an infrastructure failure as an attempt; the step is resubmitted after its backoff
        (:class:`InfraRetries`).

        The step keeps its lease (it stays RUNNING for every reader, with the attempt in its events)
        and resumes from whatever it committed: a training step from its last checkpoint."""
        lease = self.keeper.get(s)
        if lease is None:  # taken over meanwhile: not ours to retry
            self._finish(s, Outcome.LOST)
            return
        message = self.retries.describe(s, mask_text(error), *self.retries.schedule(s))
        try:
            st.write_status(s.output_path, StepStatus.RUNNING, lease=lease, message=message)
        except Exception as e:  # noqa: BLE001 - the record is the store's; the retry goes on without it
            logger.error("step %s: could not record the retry: %s", s.name, e)
        self._print(f"RETRY {s.name}: {message}")

    def _resubmit_due(self) -> None:
        for s in self.retries.pop_due():
            if not self.keeper.holds(s):  # the lease was lost while waiting
                self._finish(s, Outcome.LOST)
                continue
            try:
                ref = submit(s, self.args[s])
            except Exception as e:  # noqa: BLE001 - submission failed: the step failed
                self._record_failure(s, f"{type(e).__name__}: {e}", traceback.format_exc())
                continue
            self.running[ref] = s
            self.refs[s] = ref

    def interrupt(self, signum: int = signal.SIGINT) -> None:
        """A stop signal: stop every step this driver holds, record it INTERRUPTED, release its
        lease (see :mod:`marin.execution.stop`)."""
        stopped = Stopper(self.running, self.keeper, self._on_done, self._print).stop(signum)
        for s, note in stopped.items():
            self.outcome[s.output_path] = Outcome.INTERRUPTED
            if note:
                self.stop_notes[s.output_path] = note

    def _check_waiting(self) -> None:
        now = time.monotonic()
        for s, since in list(self.waiting.items()):
            if now - since < self.opts.poll_interval:
                continue
            self.waiting[s] = now
            lease = read_lease(s.output_path)
            if lease is not None and not is_stale(lease, time.time(), socket.gethostname()):
                continue  # a live executor is on it
            del self.waiting[s]
            self._start(s)  # may find SUCCESS (reuse), FAILED (fail), or take over

    def _print(self, msg: str) -> None:
        msg = mask_text(msg)  # every line the driver prints about a step may quote its error or config
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
        with self.keeper.running():  # the heartbeat renews every held lease, through a stop's grace period too
            try:
                while self.ready or self.running or self.waiting or self.retries.waiting:
                    self._step_loop(ray, window)
            except KeyboardInterrupt as e:
                self.interrupt(signal_of(e, self.signals))
                raise
            finally:
                self.bar.close()

    def _step_loop(self, ray: Any, window: int) -> None:
        """One turn of the loop: submit what is ready within ``window``, resubmit what waited out its
        backoff, cancel what lost its lease, look at steps other drivers hold, collect what finished."""
        while self.ready and len(self.running) < window:
            self._start(self.ready.popleft())
        if self.retries.waiting:
            self._resubmit_due()
        lost = self.keeper.lost_among(self.refs)
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
        elif (self.waiting or self.retries.waiting) and not self.ready:
            time.sleep(min(self.opts.poll_interval, 0.2))
        waiting = len(self.waiting) + self.pool_waits.count(list(self.running.values()))
        self.bar.set_postfix(running=len(self.running), waiting=waiting, refresh=False)


def run_plan(plan: Plan, opts: RunOptions) -> RunResult:
    """Run every unfinished step of ``plan`` (see module docstring); raise ExecutorError on failure."""
    mask_log_records()  # the driver's log lines, as every other string a user sees, masked
    statuses = run_statuses(plan, opts)
    todo, outcome = selected(plan, statuses, opts)
    if opts.dry_run:
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
    record = _run_on_ray(runner, outcome)
    return _result(runner, outcome, record)


def _run_on_ray(runner: _Runner, outcome: dict[str, Outcome]) -> str | None:
    """Start (or join) Ray, run the steps, stop a cluster we started; ``outcome`` gets every step's.
    Returns the experiment record's path. A stop signal is raised as :class:`ExecutorInterrupted`."""
    plan, opts = runner.plan, runner.opts
    started = False
    # space held back on a local prefix, so a step that fills the disk still gets its failure recorded
    with storage.space_reserved(plan.prefix), StopSignals() as signals:
        runner.signals = signals
        try:
            # Ray imported here, before the preparing thread pickles with its cloudpickle (an import in
            # that thread would race this one and skip import_ray_for_the_driver's care); it starts below
            import_ray_for_the_driver()
            preparing = threading.Thread(target=runner.prepare, name="marin-prepare-steps", daemon=True)
            preparing.start()
            try:
                started = ensure_ray(opts.address)
            except RunStopped as e:  # ray.init's own handler took it, not ours: later signals are only noted
                signals.note(e.signum)
                raise
            finally:
                runner._stop_preparing.set()  # from here the loop prepares what is left as it submits
            preparing.join()
            signals.install()  # in case ray.init put its own SIGTERM handler in (ensure_ray leaves it out)
            write_experiment_record(plan, opts, outcome, runner.record_steps)
            runner.loop()
        except KeyboardInterrupt as e:
            with signals.deferred("recording the stop"):
                outcome.update(runner.outcome)
                raise _interrupted(runner, outcome, signal_of(e, signals)) from None
        finally:
            # a cluster we started ends with the run, agents included, signal or not
            with signals.deferred("stopping the Ray cluster"):
                if started:
                    shutdown_local_ray()
                    signals.install()  # ray.shutdown may have put SIGTERM back to its default action
        with signals.deferred("recording the run"):
            outcome.update(runner.outcome)
            try:
                record = write_experiment_record(plan, opts, outcome, runner.record_steps)
            except OSError as e:
                if disk_full_error(e) is None:
                    raise
                record = None  # the steps' own records are what the next run reads
                print(f"(the experiment record was not updated: disk full: {e.strerror} under {plan.prefix}; "
                      "free space and rerun)", file=sys.stderr)
            if signals.received is not None:  # every step had ended; the stop still ends the process as asked
                raise _interrupted(runner, outcome, signals.received, during=signals.received_during, record=record)
    return record


def _interrupted(runner: _Runner, outcome: dict[str, Outcome], signum: int, *, during: str | None = None,
                 record: str | None = None) -> ExecutorInterrupted:
    return interrupted_error(runner.plan, runner.opts, outcome, runner.errors, runner.stop_notes, signum,
                             during=during, record=record)


def _result(runner: _Runner, outcome: dict[str, Outcome], record: str | None) -> RunResult:
    """The run's result, after a one-line count of outcomes; raises :class:`ExecutorError` (with the
    result attached) naming each step that failed and why."""
    plan, todo = runner.plan, runner.todo
    result = RunResult(plan, outcome, record, runner.errors)
    bad = [s for s in todo if outcome.get(s.output_path) in (Outcome.FAILED, Outcome.LOST) or s in runner.refused]
    counts = collections.Counter(outcome.values())
    print(
        "Steps: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + f"  (record: {record})",
        file=sys.stderr,
    )
    if bad:
        lines = [f"{len(bad)} step(s) failed:"]
        for s in bad:
            lines.append(f"--- step {s.name} ({s.output_path}) ---\n{runner.errors.get(s.output_path, '')}")
        dep = [s.name for s in todo if outcome.get(s.output_path) == Outcome.DEP_FAILED and s not in runner.refused]
        if dep:
            lines.append(f"not run because a dependency failed: {', '.join(dep)}")
        err = ExecutorError("\n".join(lines))
        err.result = result  # type: ignore[attr-defined]
        raise err
    return result
