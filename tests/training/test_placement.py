"""Pool placement on a real Ray cluster: steps queue for a busy pool, an infeasible pool fails at
once, and nodes whose hosts failed in a step are left out of its next placement.

The fast tests run on the session's local cluster, whose ``test-accelerator: 2`` plays the part of
a two-device machine; the bad-node test starts a cluster of fake nodes (Ray's cluster utilities)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import ray.cloudpickle

from marin.execution import ExecutorStep, this_output_path, versioned
from marin.execution.main import ExecutorMainConfig, executor_main
from marin.pools import (
    PLACEMENT_FILE,
    PlacementNote,
    PoolInfeasibleError,
    PoolSpec,
    launch,
)
from marin.review.steps import placement_lines

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import tests/
REPO = Path(__file__).resolve().parents[2]

# one device of the session cluster's two per host; no CPU, so the six steps compete for two devices only
ONE_DEVICE = PoolSpec("test-1dev", hosts=1, devices_per_host=1, accelerator="cpu", mesh=(1, 1), cpus_per_host=0,
                      device_resource="test-accelerator", ready_timeout_s=1.0)


def _hold(ctx, seconds):
    time.sleep(seconds)
    return os.getpid()


@dataclasses.dataclass(frozen=True)
class PoolStepCfg:
    out: str
    seconds: float
    index: int = 0
    devices: int = 1


def pool_step(cfg: PoolStepCfg) -> None:
    """A step on ``ONE_DEVICE`` (or ``devices`` of them) holding it longer than the pool's ready timeout."""
    pool = dataclasses.replace(ONE_DEVICE, devices_per_host=cfg.devices, mesh=(1, cfg.devices))
    launch(pool, _hold, (cfg.seconds,), step_dir=cfg.out)


def test_a_reservation_waits_while_another_holds_what_it_needs(tmp_path, ray_local):
    """The wait itself, without host processes: a placement group holds both devices, the pool's
    reservation waits past its ready timeout, noted with its holder, and is placed once they are free."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from marin.pools.placement import placement_groups as groups_of
    from marin.pools.placement import wait_for_placement

    holder = placement_group([{"test-accelerator": 2.0}], name="holder-step-0123 other-pool-rack0-x")
    ray.get(holder.ready())
    step_dir = tmp_path / "step"
    step_dir.mkdir()
    groups = groups_of(ONE_DEVICE, "step ")
    note = PlacementNote(str(step_dir))
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (wait_for_placement(ONE_DEVICE, groups, list, note), done.set()))
    waiter.start()
    try:
        deadline = time.time() + 60
        while not (step_dir / PLACEMENT_FILE).exists() and time.time() < deadline:
            time.sleep(0.1)
        [line] = placement_lines(str(step_dir), running=True)
        assert line.startswith("waiting for 1 x test-accelerator: held by holder-step-0123 other-pool-rack0-x "
                               "(2 test-accelerator) (for "), line
        assert not done.is_set()
    finally:
        remove_placement_group(holder)
        waiter.join(timeout=60)
    for g in groups:
        remove_placement_group(g)
    assert done.is_set()
    saved = json.loads((step_dir / PLACEMENT_FILE).read_text())
    assert saved["waiting"] is None and saved["waited"]["s"] >= 2.0  # noted after 2 s, placed once freed
    assert placement_lines(str(step_dir), running=True) == []


def test_a_node_left_out_makes_a_placement_that_only_it_could_hold_fail_naming_it(tmp_path, ray_local):
    """Node avoidance is Ray's node-id label selector: leaving out the session cluster's only node
    leaves nowhere to go, and the one line says which node was left out and why."""
    from marin.pools.placement import nodes_to_avoid, wait_for_placement
    from marin.pools.placement import placement_groups as groups_of

    node = ray.get_runtime_context().get_node_id()
    note = PlacementNote(str(tmp_path))
    note.add_bad_nodes([{"node_id": node, "ip": "127.0.0.1", "why": "host 0: ActorDiedError"}])
    assert nodes_to_avoid(ONE_DEVICE, note) == []  # bad_node_limit 0: noted, not left out
    avoiding = dataclasses.replace(ONE_DEVICE, bad_node_limit=1)
    assert nodes_to_avoid(avoiding, PlacementNote(str(tmp_path))) == [node]  # read back from the step directory
    groups = groups_of(avoiding, "", [node])
    try:
        with pytest.raises(PoolInfeasibleError) as e:
            wait_for_placement(avoiding, groups, list, note)
    finally:
        from ray.util.placement_group import remove_placement_group

        for g in groups:
            remove_placement_group(g)
    assert str(e.value).endswith(f"left out because a host of this step failed there: {node[:12]} (127.0.0.1: "
                                 "host 0: ActorDiedError)")
    note.add_bad_nodes([{"node_id": "f" * 56, "ip": "?", "why": "gone"}])  # a node no longer in the cluster
    assert nodes_to_avoid(avoiding, note) == [node]  # needs no avoiding, and does not count
    # more nodes than the limit: the fake-node test below (it needs two live nodes)


@pytest.mark.slow  # about 40 s here (two host processes, one after the other); its core is the test above
def test_a_pool_step_waits_for_a_pool_another_step_holds(tmp_path, ray_local):
    """Two steps whose pool takes the whole cluster's devices: the second waits for the first."""
    steps = [ExecutorStep(f"whole{i}", pool_step, PoolStepCfg(this_output_path(), 1.5, versioned(i), devices=2),
                          resources={"num_cpus": 0}) for i in range(2)]
    result = executor_main(ExecutorMainConfig(prefix=str(tmp_path / "out"), progress=False), steps=steps)
    assert sorted(result.outcome.values()) == ["succeeded"] * 2
    notes = [json.loads((Path(p) / PLACEMENT_FILE).read_text()) for p in result.outcome
             if (Path(p) / PLACEMENT_FILE).exists()]
    [waited] = [n["waited"] for n in notes]  # the one that came second, past the ready timeout
    assert waited["for"] == "1 x 2 test-accelerator" and waited["s"] > ONE_DEVICE.ready_timeout_s
    assert waited["held_by"][0].startswith("whole") and waited["held_by"][0].endswith("(2 test-accelerator)")


@pytest.mark.slow  # about 60 s here: six host processes, two at a time
def test_six_pool_steps_queue_for_two_devices_and_all_succeed(tmp_path, ray_local):
    steps = [ExecutorStep(f"pool{i}", pool_step, PoolStepCfg(this_output_path(), 1.5, versioned(i)),
                          resources={"num_cpus": 0}) for i in range(6)]
    prefix = tmp_path / "out"
    seen: list[str] = []
    stop = threading.Event()

    def look():  # what `marin status` prints for the running steps while they wait
        while not stop.is_set():
            for d in prefix.glob("pool*"):
                if (d / ".executor_lease").exists():
                    seen.extend(placement_lines(str(d), running=True))
            time.sleep(0.2)

    watcher = threading.Thread(target=look)
    watcher.start()
    try:
        result = executor_main(ExecutorMainConfig(prefix=str(prefix), progress=False), steps=steps)
    finally:
        stop.set()
        watcher.join()
    assert sorted(result.outcome.values()) == ["succeeded"] * 6
    notes = [json.loads((Path(p) / PLACEMENT_FILE).read_text()) for p in result.outcome if
             (Path(p) / PLACEMENT_FILE).exists()]
    waited = [n["waited"] for n in notes if n.get("waited")]
    # only two run at a time: at least the last two waited for two others each, past the ready timeout
    assert sum(1 for w in waited if w["s"] > ONE_DEVICE.ready_timeout_s) >= 2, waited
    assert all(n["waiting"] is None for n in notes)
    assert all(w["for"] == "1 x test-accelerator" for w in waited)
    held = [line for line in seen if line.startswith("waiting for 1 x test-accelerator: held by pool")]
    assert held, seen  # the holders are named by their steps' directories
    assert " test-1dev-rack0-" in held[0] and "(1 test-accelerator)" in held[0]


def test_an_infeasible_pool_fails_in_one_line(ray_local, monkeypatch):
    too_big = dataclasses.replace(ONE_DEVICE, name="too-big", devices_per_host=3, mesh=(1, 3), ready_timeout_s=1.0)
    with pytest.raises(PoolInfeasibleError) as e:
        launch(too_big, _hold, (0.0,))
    assert str(e.value).startswith("pool too-big: no node of the Ray cluster can hold 1 x 3 test-accelerator "
                                   "within 1 s; its 1 node(s) offer: 2 test-accelerator")
    assert "\n" not in str(e.value)
    # on the local cluster `marin run` starts (it cannot grow), at once: no ready timeout to wait out
    monkeypatch.setenv("MARIN_RAY_CLUSTER_FIXED", "1")
    never = dataclasses.replace(too_big, ready_timeout_s=3600.0)
    with pytest.raises(PoolInfeasibleError, match="3 test-accelerator .this local cluster cannot grow."):
        launch(never, _hold, (0.0,))
    from marin.execution.failures import is_infrastructure_failure

    assert not is_infrastructure_failure(e.value)  # a retry cannot help: the step fails


def _die_first(ctx, marker):
    if not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(1)  # the host's process dies: its node is noted
    import ray

    return ray.get_runtime_context().get_node_id()


@pytest.mark.slow  # about 45 s here: three host launches; its core is the two tests above
def test_a_failed_hosts_node_is_noted_and_left_out_only_within_the_limit(tmp_path, ray_local):
    step_dir = tmp_path / "step"
    step_dir.mkdir()
    pool = dataclasses.replace(ONE_DEVICE, max_retries=1)
    [node] = launch(pool, _die_first, (str(tmp_path / "died"),), step_dir=str(step_dir))
    note = json.loads((step_dir / PLACEMENT_FILE).read_text())
    assert [n["node_id"] for n in note["bad_nodes"]] == [node]  # limit 0: noted, the same node reused
    assert note["bad_nodes"][0]["why"] == "host 0: ActorDiedError"
    assert placement_lines(str(step_dir), running=False) == [
        f"hosts failed on node(s) {node[:12]} ({note['bad_nodes'][0]['ip']}, host 0: ActorDiedError)"]
    # with a limit, the next placement leaves that node out; here it is the only one: one line, naming it
    avoiding = dataclasses.replace(ONE_DEVICE, bad_node_limit=1, ready_timeout_s=1.0)
    with pytest.raises(PoolInfeasibleError) as e:
        launch(avoiding, _hold, (0.0,), step_dir=str(step_dir))
    assert f"left out because a host of this step failed there: {node[:12]}" in str(e.value)


_FAKE_NODES = textwrap.dedent(
    """
    import json, os, sys, time
    import dataclasses
    import ray
    from ray.cluster_utils import Cluster
    from marin.pools import PLACEMENT_FILE, PoolLaunchError, PoolSpec, launch

    out = sys.argv[1]
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(2):
        cluster.add_node(num_cpus=1, resources={"fake_host": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    pool = PoolSpec("fake-1", hosts=1, devices_per_host=1, accelerator="cpu", mesh=(1, 1), cpus_per_host=0,
                    device_resource="fake_host", max_retries=2, bad_node_limit=1, ready_timeout_s=5.0)

    def die_on_first_node(ctx, step_dir):
        node = ray.get_runtime_context().get_node_id()
        with open(step_dir + "/nodes", "a") as f:
            f.write(node + "\\n")
        if len(open(step_dir + "/nodes").read().split()) == 1:
            os._exit(1)
        return node

    def always_die(ctx, step_dir):
        with open(step_dir + "/nodes", "a") as f:
            f.write(ray.get_runtime_context().get_node_id() + "\\n")
        os._exit(1)

    first = out + "/first"
    os.makedirs(first)
    [ran_on] = launch(pool, die_on_first_node, (first,), step_dir=first)
    second = out + "/second"
    os.makedirs(second)
    try:
        launch(pool, always_die, (second,), step_dir=second)
        error = None
    except PoolLaunchError as e:
        error = f"{type(e).__name__}: {e}"
    print("RESULT " + json.dumps({
        "first_nodes": open(first + "/nodes").read().split(), "ran_on": ran_on,
        "first_note": json.load(open(first + "/" + PLACEMENT_FILE)),
        "second_nodes": open(second + "/nodes").read().split(), "error": error}))
    ray.shutdown()
    cluster.shutdown()
    """
)


@pytest.mark.slow  # about 40 s: a cluster of three fake nodes, four host launches
def test_bad_nodes_are_left_out_on_a_cluster_of_fake_nodes(tmp_path):
    script = tmp_path / "fake_nodes.py"
    script.write_text(_FAKE_NODES)
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    first, then = result["first_nodes"]
    assert first != then == result["ran_on"]  # the relaunch left the failed host's node out
    assert [n["node_id"] for n in result["first_note"]["bad_nodes"]] == [first]
    # a step whose host fails on every node: the second node is left out too, and one more is past the limit
    a, b = result["second_nodes"][:2]
    assert a != b and len(result["second_nodes"]) == 2
    assert result["error"].startswith("PoolLaunchError: pool fake-1: hosts of this step failed on 2 nodes, more "
                                      "than its bad_node_limit 1: "), result["error"]
    assert a[:12] in result["error"] and b[:12] in result["error"]
