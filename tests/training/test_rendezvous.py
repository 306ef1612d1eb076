"""The start-up rendezvous on the real launcher: two host processes of a pool join one JAX runtime
through ``jax.distributed`` on the session's Ray cluster (one rack per host, so both fit its one
node). A host that ends before it reaches the rendezvous, or hangs past the pool's registration
timeout (the waiting host's process is then ended by XLA's coordination client), fails the attempt;
the launcher relaunches the pool on a budget of its own (``rendezvous_retries``, with backoff),
writes each failure where ``marin status`` reads it, and after the last attempt names the hosts that
never joined."""

import json
import os
import sys
import time

import pytest
import ray.cloudpickle

from marin.execution.failures import is_infrastructure_failure
from marin.pools import PLACEMENT_FILE, PoolSpec, RendezvousError, launch
from marin.review.steps import placement_lines

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the host processes cannot import this module


def two_hosts(**fields) -> PoolSpec:
    """Two hosts of one fake CPU device each, a rack each: both land on the session cluster's one node."""
    return PoolSpec("rdv-2", hosts=2, devices_per_host=1, accelerator="cpu", mesh=(2, 1), racks=2,
                    rendezvous_backoff_s=0.0, **fields)


def host_1_fails_by_plan(ctx, plan_dir: str) -> None:
    """Host 1's start, before the rendezvous: the n-th attempt does ``plan[n]`` ("exit": the process
    ends at once, as a crashed host; "hang": it sleeps past every timeout, as a host stuck in its
    setup; anything else: it goes on)."""
    if ctx.process_id != 1:
        return
    n = len([f for f in os.listdir(plan_dir) if f.startswith("attempt-")])
    open(os.path.join(plan_dir, f"attempt-{n}"), "w").close()
    with open(os.path.join(plan_dir, "plan.json")) as f:
        plan = json.load(f)
    what = plan[n] if n < len(plan) else "join"
    if what == "exit":
        os._exit(1)
    if what == "hang":
        time.sleep(600)


def process_count(ctx) -> tuple[int, int]:
    import jax

    return jax.process_index(), jax.process_count()


def _plan(tmp_path, *steps: str) -> str:
    plan_dir = tmp_path / "plan"
    plan_dir.mkdir()
    (plan_dir / "plan.json").write_text(json.dumps(list(steps)))
    return str(plan_dir)


@pytest.mark.slow  # three launches of two host processes, one waiting out a registration timeout: 80 s here
def test_a_host_that_ends_then_one_that_hangs_before_the_rendezvous_are_retried_and_counted(ray_local, tmp_path):
    plan = _plan(tmp_path, "exit", "hang", "join")
    step_dir = tmp_path / "step"
    step_dir.mkdir()
    pool = two_hosts(rendezvous_timeout_s=3.0, rendezvous_retries=2, max_retries=0)
    results = launch(pool, process_count, host_setup=lambda ctx: host_1_fails_by_plan(ctx, plan),
                     step_dir=str(step_dir))
    assert results == [(0, 2), (1, 2)]  # the third attempt: both hosts in one runtime
    note = json.loads((step_dir / PLACEMENT_FILE).read_text())
    failures = note["rendezvous_failures"]
    assert [f["attempt"] for f in failures] == [1, 2]  # max_retries 0: the rendezvous has a budget of its own
    first, second = ({m["host"]: m["why"] for m in f["never_joined"]} for f in failures)
    assert first[1] == "ended before reaching it (ActorDiedError)"
    assert second[1] == "never reached it" and second[0] in ("reached it and waited for the others",
                                                             "ended before reaching it (ActorDiedError)")
    [line] = placement_lines(str(step_dir), running=False)  # what marin status shows for the step
    assert line.startswith("start-up rendezvous failed 2 time(s); the last time, never joined: host 1 ("), line


def test_after_the_last_rendezvous_attempt_the_message_names_the_hosts_that_never_joined(ray_local, tmp_path):
    plan = _plan(tmp_path, "exit", "exit")
    pool = two_hosts(rendezvous_timeout_s=30.0, rendezvous_retries=1, max_retries=3)
    with pytest.raises(RendezvousError) as e:
        launch(pool, process_count, host_setup=lambda ctx: host_1_fails_by_plan(ctx, plan))
    [first_line] = str(e.value).splitlines()
    assert first_line.startswith("pool rdv-2: host(s) 1 (") and "never joined the start-up rendezvous" in first_line
    assert "host 1 ended before reaching it (ActorDiedError)" in first_line
    assert "2 failed attempt(s) of 2 allowed" in first_line  # rendezvous_retries 1, not max_retries 3
    assert sorted(os.listdir(plan)) == ["attempt-0", "attempt-1", "plan.json"]
    assert is_infrastructure_failure(e.value)  # the executor may still rerun the step (its infra_retries)
