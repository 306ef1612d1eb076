"""A watchdog that stops what a local Ray cluster left running when its driver was killed outright.

A driver that ends as it should stops the local cluster it started completely, agents included
(:func:`marin.execution.cluster.shutdown_local_ray`, :func:`~marin.execution.cluster.local_cluster_with_nodes`).
A driver killed outright (SIGKILL, the out-of-memory killer) runs no code at all: Ray's GCS and
raylets share its fate, but the dashboard and runtime-env agents the raylets spawned notice only by
polling and live on for a minute or two, holding memory and the ports the next local cluster wants.

So a cluster the driver starts comes with this watchdog, a process of its own (in a session of its
own, ignoring stop signals: a Ctrl-C reaches the terminal's whole process group, and the watchdog
must outlast the driver's stop). Every second it notes the driver's descendants (by pid and start
time). The driver holds the write end of a pipe whose read end is the watchdog's stdin; when it
stops the cluster it writes :data:`STOPPED` and closes it, and the watchdog exits. When the pipe
closes without that word the driver died without stopping its cluster, and the watchdog stops every
process it noted that still runs (SIGTERM, then SIGKILL; never a reused pid). It says ``watching`` on
stdout once it has noted the driver's processes a first time::

    python -I -S marin/execution/reaper.py DRIVER_PID GRACE_S   (stdin: the pipe)

It starts while the cluster does, on the CPUs the cluster's start is waiting for, so it is this
file alone on the standard library (``-I -S``, not ``-m``: importing the package would import the
whole executor, a tenth of a CPU-second or two). The helpers for a cluster's processes (found under
a pid in /proc, stopped by pid and start time) live here for that reason, and the driver's
:mod:`marin.execution.cluster` uses them from here.
"""

from __future__ import annotations

import collections
import os
import select
import signal
import sys
import time

REAPER_SCRIPT = os.path.abspath(__file__)
"""This file, as the driver starts it (``python -I -S REAPER_SCRIPT DRIVER_PID GRACE_S``)."""

STOPPED = b"stopped"
"""What the driver writes into the pipe once it has stopped its cluster itself."""

PERIOD_S = 1.0
"""How often the driver's descendants are noted: the agents start with their node and live as long."""


def proc_stat(pid: int | str) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state, ppid, ..., starttime at index 19)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> list[tuple[int, str]]:
    """``(pid, start time)`` of every process below ``pid`` (from /proc; empty where there is none).

    The start time identifies a process for later signals even if its pid is reused meanwhile."""
    children: dict[int, list[tuple[int, str]]] = collections.defaultdict(list)
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        stat = proc_stat(entry)
        if stat is None or len(stat) < 20:
            continue
        children[int(stat[1])].append((int(entry), stat[19]))
    out, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child[0])
    return out


def still_running(proc: tuple[int, str]) -> bool:
    stat = proc_stat(proc[0])
    return stat is not None and len(stat) >= 20 and stat[19] == proc[1] and stat[0] != "Z"


def processes_with_env(entry: str) -> dict[int, str]:
    """Live (non-zombie) processes other than this one whose environment holds ``entry``
    (``NAME=value``, exactly), with their command lines: everything started under that variable,
    whoever's descendant it became since (a Ray worker is its raylet's, an agent outlives its
    parent). How a benchmark or a test finds what a run it started left running."""
    want = entry.encode()
    found: dict[int, str] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if want not in f.read().split(b"\0"):
                    continue
            stat = proc_stat(name)
            if stat is None or stat[0] == "Z":
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                found[int(name)] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
    return found


def stop_processes(owned: list[tuple[int, str]], grace_s: float) -> None:
    """SIGTERM each process of ``owned`` (``(pid, start time)`` pairs) still running, then SIGKILL
    what is left after ``grace_s``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 1.0)):
        alive = [p for p in owned if still_running(p)]
        for pid, _ in alive:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait_s
        while alive and time.monotonic() < deadline:
            time.sleep(0.05)
            alive = [p for p in alive if still_running(p)]
        if not alive:
            return
        owned = alive


def watch(driver: int, grace_s: float, period_s: float = PERIOD_S) -> list[tuple[int, str]]:
    """Note ``driver``'s descendants until stdin closes; then, unless the driver wrote
    :data:`STOPPED`, stop those still running. Returns what it stopped (for the log, and tests)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    me = os.getpid()
    noted: dict[int, str] = {}
    said = b""
    while True:
        ready, _, _ = select.select([0], [], [], period_s)
        if ready:
            chunk = os.read(0, 64)
            if not chunk:
                break  # the driver closed the pipe, or died
            said += chunk
            continue
        # an agent whose raylet died first is no longer the driver's descendant: keep what still runs
        first = not noted
        noted = {pid: start for pid, start in noted.items() if still_running((pid, start))}
        noted.update((pid, start) for pid, start in descendants(driver) if pid != me)
        if first and noted:
            print("watching", flush=True)
    if STOPPED in said:
        return []
    left = [(pid, start) for pid, start in noted.items() if still_running((pid, start))]
    stop_processes(left, grace_s)
    return left


if __name__ == "__main__":
    stopped = watch(int(sys.argv[1]), float(sys.argv[2]))
    if stopped:
        print(f"marin: the driver (pid {sys.argv[1]}) died without stopping its local Ray cluster; stopped "
              f"{len(stopped)} process(es) it left: {' '.join(str(pid) for pid, _ in stopped)}", file=sys.stderr)
