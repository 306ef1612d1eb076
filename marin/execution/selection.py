"""Which steps a run runs, what it refuses to start over, and the dry run.

Every step's status is read first (object stores with a thread pool). A run refuses unreadable
records (unless asked to repair them) and steps that FAILED before (unless named with
``--retry_failed`` or all allowed with ``--force_run_failed``); it runs every unfinished step, or
with ``--run_only`` the matching ones and their unfinished dependencies. A dry run prints that
selection, with each step's state and code drift, and runs nothing.
"""

from __future__ import annotations

import re
import sys
from concurrent.futures import ThreadPoolExecutor

from marin.execution import lease as leases
from marin.execution import status as st
from marin.execution import storage
from marin.execution.errors import ExecutorError, PreviouslyFailedError, UnreadableRecordError
from marin.execution.failures import STORE_ADVICE, unreadable_store_message
from marin.execution.fingerprint import code_fingerprint, drift
from marin.execution.jsonable import mask_text
from marin.execution.options import RunOptions
from marin.execution.outcome import Outcome
from marin.execution.plan import Plan, PlannedStep, resolve_config
from marin.execution.status import StepStatus
from marin.execution.tasks import step_info


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


def run_statuses(plan: Plan, opts: RunOptions) -> dict[PlannedStep, dict | None]:
    """Every step's status record, as a run starts: an unreadable store stops a run (a dry run shows
    the plan as if nothing had run), and unreadable records stop it unless ``--repair_records``
    rebuilds them."""
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
    return statuses


def selected(plan: Plan, statuses: dict[PlannedStep, dict | None], opts: RunOptions
             ) -> tuple[list[PlannedStep], dict[str, Outcome]]:
    """The steps this run runs, dependencies first, and the outcome of those it leaves alone
    (``cached``, ``not_selected``; ``dry_run`` for the selection of a dry run). Refuses steps that
    failed before unless ``--retry_failed`` names them or ``--force_run_failed`` allows them all."""
    todo = select_steps(plan, statuses, opts.run_only)
    outcome: dict[str, Outcome] = {}
    for s in plan.steps:
        if st.current_status(statuses[s]) == StepStatus.SUCCESS:
            outcome[s.output_path] = Outcome.CACHED
        elif s not in todo:
            outcome[s.output_path] = Outcome.NOT_SELECTED
    refuse_failed_before([s for s in todo if st.current_status(statuses[s]) == StepStatus.FAILED], opts)
    if opts.dry_run:
        outcome.update({s.output_path: Outcome.DRY_RUN for s in todo})
    return todo, outcome


def refuse_failed_before(failed_before: list[PlannedStep], opts: RunOptions) -> None:
    """Raise unless every selected step that FAILED in an earlier run may run again."""
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


def print_dry_run(plan: Plan, statuses: dict, todo: list[PlannedStep]) -> None:
    """What a run would do: each step marked run or skip, with its state, output path and code drift."""
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
