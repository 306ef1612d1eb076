"""One host of a 2-process pool voting on whether a checkpoint read cleanly (test_run_loading.py).

    python two_process_vote.py PROCESS_ID COORDINATOR

Process 0 reports a clean read, process 1 a damaged one, then both a clean one; each prints the
votes' outcomes as seen by every process.
"""
import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"


def main() -> None:
    pid, coord = int(sys.argv[1]), sys.argv[2]
    from marin.inference.evaluate import every_process_agrees
    from marin.pools import HostContext, get_pool, initialize_jax

    ctx = HostContext(pid, 2, coord, get_pool("local-2host"))
    initialize_jax(ctx)
    agree = every_process_agrees(ctx)
    print("RESULT", json.dumps([agree(pid == 0), agree(True)]), flush=True)
    os._exit(0)  # the peer may be gone: skip jax.distributed's shutdown barrier


if __name__ == "__main__":
    main()
