"""Checkpoint throughput, async cost and per-process host memory (marin.training.checkpoint).

    PYTHONPATH=. python benchmarks/checkpoint_bench.py [--mib 512] [--dir /tmp/ckpt-bench]

In one run, against baselines measured in the same run:

* ``save_vs_raw``: throughput of a blocking sharded save of a state of ``--mib`` MiB (float32 leaves
  split over 8 fake CPU devices) over plain ``write`` + ``fsync`` of the same shard bytes to files in
  the same directory (goal >= 0.7). ``restore_vs_raw``: a sharded restore onto the same mesh over
  ``numpy.fromfile`` of those files (goal >= 0.7). Both sides read from the page cache.
* ``async_blocking_fraction``: the time an async save holds the training loop (copying this
  process's shards to host memory) over the time of the same save done synchronously (goal <= 0.1);
  ``async_lost_fraction`` adds what the background writes cost the steps running beside them
  (jitted matmuls standing in for training steps; on a 2-core machine they compete for the cores).
* ``host_peak_ratio_2p``: peak resident memory of one process of a two-process pool (2 x 4 devices,
  ``jax.distributed`` on 127.0.0.1) over that of a one-process pool (8 devices), each creating the
  state sharded, saving it and restoring it (goal <= 0.65).

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))


def _state(mib: int, mesh):
    """``mib`` MiB of float32 in 8 leaves split over the whole mesh, created sharded (no host copy)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = mesh.devices.size
    rows = max(n, (mib << 20) // (8 * 4 * 1024) // n * n)
    sharding = NamedSharding(mesh, P(("data", "expert"), None))
    shapes = {f"w{i}": jax.ShapeDtypeStruct((rows, 1024), jnp.float32) for i in range(8)}
    fn = jax.jit(lambda: {k: jax.random.normal(jax.random.PRNGKey(i), s.shape, s.dtype)
                          for i, (k, s) in enumerate(shapes.items())},
                 out_shardings={k: sharding for k in shapes})
    return fn(), shapes, {k: sharding for k in shapes}


def _rss() -> int:
    """Peak resident memory of this process so far (VmHWM: unlike getrusage's ru_maxrss, which Linux
    carries over from the parent across exec, it starts afresh in each process)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(args) -> None:
    """One process of the memory measurement: init sharded, save, restore; prints its peak RSS."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // args.processes}"
    import jax

    if args.processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, args.processes, args.process_id)
    from marin.parallel.mesh import make_mesh
    from marin.training import checkpoint as ckpt

    mesh = make_mesh(2, 4)
    jax.block_until_ready(jax.jit(lambda x: x + 1)(jax.numpy.zeros(4)))
    runtime = _rss()
    state, shapes, shardings = _state(args.mib, mesh)
    jax.block_until_ready(state)
    mgr = ckpt.CheckpointManager(args.dir, ckpt.CheckpointPolicy(every_steps=1, keep_last=1),
                                 is_writer=args.process_id == 0)
    mgr.save(1, state, {"bench": True})
    mgr.close()
    del state
    restored, _ = ckpt.restore_checkpoint(mgr.path_for(1), shapes, shardings)
    jax.block_until_ready(restored)
    if args.processes > 1:  # process 0 hosts the coordination service: nobody leaves before all are done
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("bench done")
    print("RESULT " + json.dumps({"process": args.process_id, "peak_rss": _rss(), "runtime_rss": runtime}),
          flush=True)
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peak_per_process(processes: int, mib: int, directory: str) -> list[dict]:
    shutil.rmtree(directory, ignore_errors=True)
    coord = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, HERE, "--worker", "--processes", str(processes), "--process-id", str(p),
                               "--coordinator", coord, "--mib", str(mib), "--dir", directory],
                              env=env, stdout=subprocess.PIPE, text=True) for p in range(processes)]
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=900)
        line = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
        if p.returncode != 0 or not line:
            raise RuntimeError(f"worker failed with exit code {p.returncode}")
        out.append(json.loads(line[-1][7:]))
    return out


def throughput(args) -> dict:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax
    import numpy as np

    from marin.parallel.mesh import make_mesh
    from marin.training import checkpoint as ckpt

    mesh = make_mesh(2, 4)
    state, shapes, shardings = _state(args.mib, mesh)
    jax.block_until_ready(state)
    nbytes = sum(x.nbytes for x in state.values())
    root = os.path.join(args.dir, "single")
    shutil.rmtree(root, ignore_errors=True)
    res: dict = {"state_bytes": nbytes}

    # raw baseline: every shard's bytes to its own file, fsync'd, then read back
    raw_dir = os.path.join(root, "raw")
    os.makedirs(raw_dir)
    shards = [(k, i, np.asarray(s.data)) for k, x in state.items() for i, s in enumerate(x.addressable_shards)]
    t0 = time.perf_counter()
    for k, i, a in shards:
        with open(os.path.join(raw_dir, f"{k}.{i}"), "wb") as f:
            f.write(a.tobytes())
            f.flush()
            os.fsync(f.fileno())
    raw_write = time.perf_counter() - t0
    t0 = time.perf_counter()
    back = [np.fromfile(os.path.join(raw_dir, f"{k}.{i}"), dtype=np.float32) for k, i, _ in shards]
    raw_read = time.perf_counter() - t0
    del back

    saves, restores = [], []
    for rep in range(args.repeats):
        path = os.path.join(root, f"ckpt-{rep}")
        t0 = time.perf_counter()
        ckpt.write_checkpoint(path, state, {}, step=rep)
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out, _ = ckpt.restore_checkpoint(path, shapes, shardings)
        jax.block_until_ready(out)
        restores.append(time.perf_counter() - t0)
        del out
    save, restore = min(saves), min(restores)
    res.update(raw_write_s=raw_write, save_s=save, raw_read_s=raw_read, restore_s=restore,
               save_vs_raw=raw_write / save, restore_vs_raw=raw_read / restore)

    # async: what a save costs the training loop
    # a stand-in step without collectives: rows split over the devices times a replicated matrix
    x0 = jax.device_put(np.ones((4096, 512), np.float32) / 512, jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(("data", "expert"), None)))
    w = jax.device_put(np.eye(512, dtype=np.float32), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    fake_step = jax.jit(lambda a, b: jnp_tanh(a @ b) + a * 0.5)

    def steps(n: int) -> float:
        x = x0
        t = time.perf_counter()
        for _ in range(n):
            x = fake_step(x, w)
        jax.block_until_ready(x)
        return time.perf_counter() - t

    steps(2)
    n = args.async_steps
    base = min(steps(n) for _ in range(2))
    mgr = ckpt.CheckpointManager(os.path.join(root, "async"), ckpt.CheckpointPolicy(every_steps=1, keep_last=1))
    t0 = time.perf_counter()
    mgr.save(1, state, {}, blocking=True)
    sync = time.perf_counter() - t0
    t0 = time.perf_counter()
    mgr.save(2, state, {})
    blocking = time.perf_counter() - t0
    with_save = steps(n)
    t1 = time.perf_counter()
    mgr.wait()
    tail = time.perf_counter() - t1
    mgr.close()
    res.update(sync_save_s=sync, async_blocking_s=blocking, steps_s=base, steps_with_save_s=with_save,
               save_still_running_after_steps_s=tail,
               async_blocking_fraction=blocking / sync,
               async_lost_fraction=(blocking + max(0.0, with_save - base)) / sync)
    return res


def jnp_tanh(x):
    import jax.numpy as jnp

    return jnp.tanh(x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=512, help="state size, MiB")
    p.add_argument("--dir", default="/tmp/marin-checkpoint-bench")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--async-steps", type=int, default=40)
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--processes", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    res = throughput(args)
    if not args.skip_memory:
        one = _peak_per_process(1, args.mib, os.path.join(args.dir, "mem1"))
        two = _peak_per_process(2, args.mib, os.path.join(args.dir, "mem2"))
        res.update(peak_rss_1p=one[0]["peak_rss"], runtime_rss_1p=one[0]["runtime_rss"],
                   peak_rss_2p=max(r["peak_rss"] for r in two), runtime_rss_2p=max(r["runtime_rss"] for r in two),
                   host_peak_ratio_2p=max(r["peak_rss"] for r in two) / one[0]["peak_rss"])
    shutil.rmtree(args.dir, ignore_errors=True)
    for k, v in res.items():
        print(f"  {k:<36} {v:,.4g}" if isinstance(v, float) else f"  {k:<36} {v:,}", file=sys.stderr)
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()}))


if __name__ == "__main__":
    main()
