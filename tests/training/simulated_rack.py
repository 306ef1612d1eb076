"""A simulated GB200 NVL72 rack on this machine: a Ray cluster of HOSTS fake nodes (as marin's
commands simulate a CPU pool's hosts: Ray's own cluster utilities, a start that misses Ray's startup
deadline retried), each a "host" with 4 fake CPU devices, one JAX process per host through the pool launcher,
one (1, 4 x HOSTS) mesh: expert parallelism across every process, as EP 64 spans the 16 compute trays
of a rack. The model has the hero's routing shape (384 experts, top-8, 2 shared experts, capacity
factor 1.15, 2 expert chunks) at a tiny width and depth.

    python tests/training/simulated_rack.py OUT HOSTS

The run: SWITCH_STEP steps on the ``fixed`` transport, then the hot switch to ``ragged_capacity``
(declared as the hero declares its switch at step 81,716: ``transport_switches``), a checkpoint every
CHECKPOINT_EVERY steps; once a checkpoint past the switch is committed and training has gone on past
it, one host (the last) is killed from outside with SIGKILL. The launcher kills the others, places the
pool again and the hosts resume from the last committed checkpoint to TRAIN_STEPS. Prints one
``RESULT {json}`` line: the metrics (step, transport, drop fractions), the kill, the host summaries,
and the wall time of each part.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time

DEVICES_PER_HOST = 4  # a GB200 compute tray: 4 GPUs
TRAIN_STEPS = 14
SWITCH_STEP = 4  # steps 1..4 on fixed, 5.. on ragged_capacity
CHECKPOINT_EVERY = 6
KILL_AFTER_STEP = CHECKPOINT_EVERY + 2  # a checkpoint past the switch is committed, and training went on
SEQ_LEN = 32
ROWS_PER_DEVICE = 1  # 32 tokens x top-8 = 256 assignments sent per device and step


def rack_model():
    """The hero's routing (384 experts, top-8, 2 shared experts, quantile balancing, capacity 1.15 in
    2 chunks of local experts) at a tiny width and depth: what the transports see is the hero's shape."""
    from marin.models.config import MoEConfig

    return MoEConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, max_seq_len=64,
                     sliding_window=16, latent_dim=16, n_experts=384, top_k=8, expert_width=8, n_shared_experts=2,
                     shared_width=16, capacity_factor=1.15, expert_chunks=2, transport="fixed", dtype="float32")


def rack_pool(hosts: int):
    """``hosts`` simulated nodes x 4 fake devices, all of them on the expert axis, on distinct nodes of
    one rack label (as gb200-rack places them); up to 3 relaunches after a lost host, as gb200-rack allows."""
    from marin.pools import RACK_LABEL, PoolSpec

    return PoolSpec(f"sim-rack-{hosts}x{DEVICES_PER_HOST}", hosts=hosts, devices_per_host=DEVICES_PER_HOST,
                    accelerator="cpu", mesh=(1, hosts * DEVICES_PER_HOST), device_resource="fake_host",
                    rack_label=RACK_LABEL, max_retries=3)


def host_main(ctx, config, pid_dir):
    """The host function: note this process's pid (the test's killer reads it), then train or resume.

    No persistent compilation cache: JAX writes it from process 0 alone, and with one every relaunch
    failed the same way, the first collective waiting past gloo's 30 s rendezvous for process 1 (as
    if only process 0 found its programs there and the others compiled them again)."""
    from marin.training.trainer import train_on_host

    with open(os.path.join(pid_dir, f"host-{ctx.process_id}-{os.getpid()}"), "w") as f:
        f.write(str(time.time()))
    return train_on_host(ctx, config)


def main() -> None:
    from marin.pools import launch
    from marin.pools.local import pool_cluster
    from marin.training.checkpoint import committed_steps
    from marin.training.config import (
        AdamWConfig,
        CheckpointPolicy,
        ParallelismConfig,
        SyntheticDataConfig,
        TelemetryConfig,
        TrainConfig,
    )
    from marin.training.metrics import read_metrics

    out, hosts = sys.argv[1], int(sys.argv[2])
    run_dir, pid_dir = f"{out}/run", f"{out}/pids"
    os.makedirs(pid_dir, exist_ok=True)
    pool = rack_pool(hosts)
    config = TrainConfig(
        output_path=run_dir, pool="gb200-rack", data=SyntheticDataConfig(vocab_size=512), model=rack_model(),
        train_steps=TRAIN_STEPS, tokens_per_step=pool.num_devices * ROWS_PER_DEVICE * SEQ_LEN,
        seq_len_phases=((0.0, SEQ_LEN),), optimizer=AdamWConfig(warmup_steps=1, peak_lr=1e-2),
        parallelism=ParallelismConfig(microbatches=1,
                                      transport_switches=((0, "fixed"), (SWITCH_STEP, "ragged_capacity"))),
        checkpoint=CheckpointPolicy(every_steps=CHECKPOINT_EVERY, every_minutes=None),
        telemetry=TelemetryConfig(wandb_project=None, progress_every_s=1e9))

    killed: dict = {}
    first_step_at: list[float] = []

    def steps_done() -> list[int]:
        try:
            return [r["step"] for r in read_metrics(run_dir)]
        except (FileNotFoundError, ValueError):  # not started yet, or a line being written
            return []

    def kill_one_host() -> None:
        """From outside, as a node failure would: SIGKILL the last host's process mid-run."""
        victim = hosts - 1
        while not killed:
            steps = steps_done()
            if steps and not first_step_at:
                first_step_at.append(time.time())
            if steps and steps[-1] >= KILL_AFTER_STEP and any(s > SWITCH_STEP for s in committed_steps(run_dir)):
                [pid] = [int(n.rsplit("-", 1)[1]) for n in os.listdir(pid_dir) if n.startswith(f"host-{victim}-")]
                committed = committed_steps(run_dir)
                os.kill(pid, signal.SIGKILL)
                killed.update(host=victim, pid=pid, after_step=steps[-1], committed=committed, at=time.time())
                return
            time.sleep(0.05)

    # the cluster as `marin sample/eval --pool` simulates a pool's hosts: one Ray node per host (its fake
    # devices, its rack label) beside the head, a node that misses Ray's 30 s startup deadline on a busy
    # machine started again, and every process stopped at the end (stdout goes to stderr meanwhile)
    t0 = time.time()
    with pool_cluster(pool):
        t_cluster = time.time() - t0
        threading.Thread(target=kill_one_host, daemon=True).start()
        t_launch = time.time()
        summaries = launch(pool, host_main, (config, pid_dir))
        t_end = time.time()
    records = read_metrics(run_dir)
    launches = sorted(os.listdir(pid_dir))
    print("RESULT " + json.dumps({
        "train_steps": TRAIN_STEPS, "switch_step": SWITCH_STEP, "checkpoint_every": CHECKPOINT_EVERY,
        "hosts": hosts, "devices": pool.num_devices, "mesh": list(pool.mesh),
        "steps": [r["step"] for r in records], "transports": [r["transport"] for r in records],
        "drop_frac_send": [r["drop_frac_send"] for r in records],
        "drop_frac_recv": [r["drop_frac_recv"] for r in records],
        "killed": killed, "summaries": summaries, "host_processes_started": len(launches),
        "committed": committed_steps(run_dir),
        "cluster_start_s": round(t_cluster, 1),
        "first_step_s": round(first_step_at[0] - t_launch, 1) if first_step_at else None,
        "resume_s": round(t_end - killed["at"], 1) if killed else None,
        "train_s": round(t_end - t_launch, 1), "wall_s": round(t_end - t0, 1),
        "config": dataclasses.asdict(config.model) | {"tokens_per_step": config.tokens_per_step},
    }), flush=True)


if __name__ == "__main__":
    main()
