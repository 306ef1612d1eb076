"""A simulated GB200 NVL72 rack (tests/training/simulated_rack.py): a Ray cluster of fake nodes, one JAX
process per node with 4 fake CPU devices, one mesh with expert parallelism over all of them and the
hero's routing shape (384 experts, top-8); a few steps on ``fixed``, the hot switch to
``ragged_capacity``, a checkpoint, one host killed with SIGKILL mid-run, the pool relaunched by the
launcher and training resumed from the checkpoint, the metrics going on without a duplicate step.

The declared configuration is the rack's: 16 nodes x 4 devices, mesh (1, 64), 6 local experts per
device as on the hero. ``MARIN_RACK_HOSTS`` selects the node count (2, 4, 8 or 16; 384 experts divide
over each); its default is 4. On the 2-core, 24 GiB development machine 8 nodes pass (11 min, 10.6 GiB
PSS at the peak) and 16 train their ``fixed`` steps, then run out of host memory compiling the
``ragged_capacity`` step (16 hosts at 1.2 GB each and 17 Ray nodes' daemons);
docs/performance.md, "A simulated NVL72 rack", has the numbers.

    MARIN_RACK_HOSTS=16 .venv/bin/python -m pytest -q -s -m slow tests/training/test_rack.py
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from marin.pools import with_device_count

REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("simulated_rack.py")
RACK_HOSTS = int(os.environ.get("MARIN_RACK_HOSTS", "4"))
MIN_AVAILABLE = 1 << 30
"""The test stops its process tree when the machine's available memory falls below this, so a rack too
large for the machine fails with its numbers instead of the kernel killing processes at random."""


class TreeMemory:
    """Samples the resident memory of a process and all its descendants (the driver, the Ray head and
    node daemons, the JAX host processes): the peak of the sum of their RSS, and the processes then.

    RSS counts a page shared by several processes (the Python runtime's libraries) once per process,
    so the sum overstates what the machine holds; PSS (each shared page split among its sharers) is
    sampled beside it where the kernel gives it."""

    def __init__(self, pid: int, every_s: float = 0.5, min_available: int = 0) -> None:
        self.root, self.every_s, self.min_available = psutil.Process(pid), every_s, min_available
        self.peak_rss = self.peak_pss = 0
        self.peak_processes = 0
        self.min_seen_available = psutil.virtual_memory().available
        self.stopped_for_memory: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> tuple[int, int, int]:
        """(sum of RSS, sum of PSS, process count) of the tree now; processes that exit meanwhile are skipped."""
        rss = pss = n = 0
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0, 0, 0
        for p in procs:
            try:
                info = p.memory_full_info()
            except psutil.AccessDenied:
                try:
                    info = p.memory_info()
                except psutil.Error:
                    continue
            except psutil.Error:
                continue
            rss += info.rss
            pss += getattr(info, "pss", info.rss)
            n += 1
        return rss, pss, n

    def kill_tree(self) -> None:
        """SIGKILL the process and every descendant (Ray's daemons outlive a killed driver)."""
        try:
            procs = [*self.root.children(recursive=True), self.root]
        except psutil.NoSuchProcess:
            return
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()

    def _run(self) -> None:
        while not self._stop.is_set():
            rss, pss, n = self.sample()
            if rss > self.peak_rss:
                self.peak_rss, self.peak_processes = rss, n
            self.peak_pss = max(self.peak_pss, pss)
            available = psutil.virtual_memory().available
            self.min_seen_available = min(self.min_seen_available, available)
            if available < self.min_available:  # stop the tree before the kernel's OOM killer picks a victim
                self.stopped_for_memory = (f"the machine's available memory fell to {available / 2**30:.2f} GiB "
                                           f"with the tree at {rss / 2**30:.2f} GiB RSS, {pss / 2**30:.2f} GiB PSS "
                                           f"in {n} processes")
                self.kill_tree()
                return
            self._stop.wait(self.every_s)

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def test_tree_memory_counts_the_children_of_a_process():
    """The sampler sums a child's memory into its parent's tree: a child that holds 200 MB more
    raises the sum by about that (RSS of touched pages; 20% either way for the interpreter's own).
    The parent is a process of this test's own: the test process's other children (a Ray cluster an
    earlier test started) come and go between two samples."""
    hold = ("import sys, time; b = bytearray(int(sys.argv[1])); b[::4096] = b'x' * len(b[::4096]); "
            "print(1, flush=True); time.sleep(60)")
    spawner = ("import subprocess, sys; print(1, flush=True); sys.stdin.readline(); "
               f"c = subprocess.Popen([sys.executable, '-c', {hold!r}, str(200 << 20)], stdout=subprocess.PIPE); "
               "c.stdout.readline(); print(c.pid, flush=True); c.wait()")
    parent = subprocess.Popen([sys.executable, "-c", spawner], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        parent.stdout.readline()
        base_rss, _, base_n = TreeMemory(parent.pid).sample()
        parent.stdin.write("go\n")
        parent.stdin.flush()
        child_pid = int(parent.stdout.readline())  # the child's buffer is touched
        rss, pss, n = TreeMemory(parent.pid).sample()
        child_rss = psutil.Process(child_pid).memory_info().rss
    finally:
        for p in psutil.Process(parent.pid).children(recursive=True):
            p.kill()
        parent.kill()
        parent.wait()
    assert n == base_n + 1
    assert child_rss > 200 << 20  # the buffer plus the interpreter
    assert abs((rss - base_rss) - child_rss) < 0.2 * child_rss  # the rest of the tree barely moved
    assert 0 < pss <= rss


def test_tree_memory_stops_the_tree_when_the_machine_runs_low():
    """Below the floor the sampler kills the whole tree (a child and its grandchild) and says why; here
    the floor is set above what the machine has, so it trips on the first sample."""
    sleeper = ("import subprocess, sys, time; "
               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", sleeper], start_new_session=True)
    try:
        deadline = time.time() + 20
        while not psutil.Process(child.pid).children() and time.time() < deadline:
            time.sleep(0.05)
        [grandchild] = psutil.Process(child.pid).children()
        with TreeMemory(child.pid, every_s=0.05, min_available=psutil.virtual_memory().total * 2) as memory:
            assert child.wait(timeout=20) == -9
        _, alive = psutil.wait_procs([grandchild], timeout=20)
        assert not alive
        assert memory.stopped_for_memory.startswith("the machine's available memory fell to ")
        assert "in 2 processes" in memory.stopped_for_memory
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, 9)


@pytest.mark.timeout(3600)
@pytest.mark.slow  # minutes: a cluster of RACK_HOSTS nodes, two pool launches, three step compilations
def test_simulated_rack_switches_transport_survives_a_killed_host_and_resumes_without_duplicates(tmp_path):
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = with_device_count(env.get("XLA_FLAGS", ""), None)  # each host process gets its own from the pool
    env.pop("RAY_ADDRESS", None)
    t = time.time()
    proc = subprocess.Popen([sys.executable, str(DRIVER), str(tmp_path / "out"), str(RACK_HOSTS)], env=env,
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        with TreeMemory(proc.pid, min_available=MIN_AVAILABLE) as memory:
            out, err = proc.communicate(timeout=3000)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    wall = time.time() - t
    assert memory.stopped_for_memory is None, (
        f"stopped the simulated rack of {RACK_HOSTS} nodes after {wall:.0f} s: {memory.stopped_for_memory}; "
        "it does not fit this machine (set MARIN_RACK_HOSTS lower)")
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    peaks = (f"peak RSS {memory.peak_rss / 2**30:.2f} GiB, PSS {memory.peak_pss / 2**30:.2f} GiB in "
             f"{memory.peak_processes} processes, {memory.min_seen_available / 2**30:.2f} GiB available at the least")
    assert proc.returncode == 0 and lines, f"{RACK_HOSTS} nodes, {wall:.0f} s, {peaks}\n{out[-4000:]}{err[-4000:]}"
    res = json.loads(lines[-1][len("RESULT "):])
    TRAIN_STEPS, SWITCH_STEP, CHECKPOINT_EVERY = res["train_steps"], res["switch_step"], res["checkpoint_every"]
    assert res["devices"] == 4 * RACK_HOSTS and res["mesh"] == [1, 4 * RACK_HOSTS]
    # every step once, on the transport the schedule names for it: fixed, then ragged_capacity
    assert res["steps"] == list(range(1, TRAIN_STEPS + 1))
    assert res["transports"] == ["fixed"] * SWITCH_STEP + ["ragged_capacity"] * (TRAIN_STEPS - SWITCH_STEP)
    assert all(0 <= d < 1 for d in res["drop_frac_send"] + res["drop_frac_recv"])
    # the kill: mid-run, after a checkpoint past the switch; the relaunch resumed from the last one
    # committed then (a save in flight at the kill may or may not have made it), and trained on
    killed = res["killed"]
    assert killed and killed["host"] == RACK_HOSTS - 1
    resumed = {s["resumed_from"] for s in res["summaries"]}
    assert len(resumed) == 1 and len(res["summaries"]) == RACK_HOSTS
    [resumed_from] = resumed
    assert resumed_from % CHECKPOINT_EVERY == 0 and SWITCH_STEP < resumed_from <= killed["after_step"], (resumed,
                                                                                                       killed)
    assert resumed_from >= max(killed["committed"])
    assert all(s["final_step"] == TRAIN_STEPS for s in res["summaries"])
    # every host started once per launch: the first, and each relaunch (a relaunch can fail too: on this
    # overloaded machine a host may reach its first collective past gloo's 30 s rendezvous)
    assert res["host_processes_started"] % RACK_HOSTS == 0 and res["host_processes_started"] >= 2 * RACK_HOSTS
    assert TRAIN_STEPS in res["committed"]
    print("RACK " + json.dumps({
        "hosts": RACK_HOSTS, "devices": res["devices"], "wall_s": round(wall, 1),
        "cluster_start_s": res["cluster_start_s"],
        "first_step_s": res["first_step_s"], "resume_s": res["resume_s"], "train_s": res["train_s"],
        "peak_rss_gib": round(memory.peak_rss / 2**30, 2), "peak_pss_gib": round(memory.peak_pss / 2**30, 2),
        "processes_at_peak": memory.peak_processes,
        "min_available_gib": round(memory.min_seen_available / 2**30, 2),
        "launches": res["host_processes_started"] // RACK_HOSTS,
        "resumed_from": resumed_from,
        "killed_after_step": killed["after_step"],
        "drop_frac_send_fixed": sum(res["drop_frac_send"][:SWITCH_STEP]) / SWITCH_STEP,
        "drop_frac_send_ragged": sum(res["drop_frac_send"][SWITCH_STEP:]) / (TRAIN_STEPS - SWITCH_STEP)}))
