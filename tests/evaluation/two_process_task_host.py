"""One host of a two-process pool (``local-2host``: 2 processes x 4 fake CPU devices, one (1, 8)
mesh, joined by ``jax.distributed`` on 127.0.0.1 as the Ray launcher joins them), started twice by
tests/evaluation/test_task_eval_multihost.py: a tiny run on a token store, weights fsdp-split across
the two processes, whose in-training eval scores a multiple-choice task only (no eval sets).

    python two_process_task_host.py OUT PROCESS_ID COORDINATOR STORE TASK
"""

import json
import os
import sys


def config(out: str, store: str, task: str):
    from marin.data.mixture import MixtureConfig
    from marin.training.config import (
        AdamWConfig,
        CheckpointPolicy,
        ParallelismConfig,
        TelemetryConfig,
        TrainConfig,
        TrainEvalConfig,
    )

    return TrainConfig(output_path=out, data=MixtureConfig(stores=(store,), validation_fraction=0.05),
                       model="tiny-ep", pool="local-2host", train_steps=4, tokens_per_step=1024,
                       seq_len_phases=((0.0, 64),), optimizer=AdamWConfig(warmup_steps=1, peak_lr=1e-2),
                       checkpoint=CheckpointPolicy(every_steps=2, every_minutes=None, keep_last=3),
                       telemetry=TelemetryConfig(wandb_project=None, progress_every_s=0.0),
                       evaluation=TrainEvalConfig(every_steps=2, held_out=False, tasks={"k40_domains": task}),
                       parallelism=ParallelismConfig(param_sharding="fsdp"))


def main() -> None:
    out, pid, coord, store, task = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    os.environ["JAX_PLATFORMS"] = "cpu"  # before JAX starts its backend: 4 fake devices per host
    from marin.pools import HostContext, get_pool, initialize_jax, with_device_count

    os.environ["XLA_FLAGS"] = with_device_count(os.environ.get("XLA_FLAGS", ""), 4)
    from marin.training.trainer import train_on_host

    ctx = HostContext(pid, 2, coord, get_pool("local-2host"))
    initialize_jax(ctx)
    summary = train_on_host(ctx, config(out, store, task))
    print("RESULT " + json.dumps({"process": pid, "summary": summary}), flush=True)
    os._exit(0)  # the peer may be gone: skip jax.distributed's shutdown barrier


if __name__ == "__main__":
    main()
