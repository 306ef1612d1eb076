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

    python -m marin.execution.reaper DRIVER_PID GRACE_S   (stdin: the pipe)
"""

from __future__ import annotations

import os
import select
import signal
import sys

from marin.execution.cluster import descendants, still_running, stop_processes

STOPPED = b"stopped"
"""What the driver writes into the pipe once it has stopped its cluster itself."""

PERIOD_S = 1.0
"""How often the driver's descendants are noted: the agents start with their node and live as long."""


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
