"""One host of a two-process pool (``local-2host``: 2 processes x 4 fake CPU devices, one (1, 8)
mesh), started twice by tests/training/test_sharded_state.py; joined by ``jax.distributed`` on
127.0.0.1, as the Ray launcher joins them (marin.pools.initialize_jax).

    python two_process_host.py MODE OUT PROCESS_ID COORDINATOR [HOSTS [EXPERT_WIDTH]]

MODE ``train``: the fresh state created sharded is saved to OUT/init, then a real run trains 4
steps into OUT/run (fsdp: weights and AdamW state split across the two processes; async saves at
steps 2 and 4). MODE ``kill``: the state is saved at step 1, then process 1 kills itself with SIGKILL
in the middle of the save of step 2, after its chunks are written and before its part record.
MODE ``memory`` (optionally over 4 hosts x 2 devices): a larger model trains 3 steps with async
saves and is restored. MODE ``store``: OUT is an object-store URL; a real run trains 12 steps saving
every 2 (the store may refuse or hold some of the writes: tests/training/test_save_faults_multihost.py),
with a part timeout of 8 s. All print one ``RESULT {json}`` line with the process's peak resident memory.
"""

import json
import os
import signal
import sys


def config(out: str, *, param_sharding: str = "fsdp", keep_last: int = 3, **kw):
    """The run both hosts train; ``param_sharding`` and ``keep_last`` (checkpoints kept) as named, ``kw``:
    TrainConfig's other fields."""
    from marin.training.config import (
        AdamWConfig,
        CheckpointPolicy,
        ParallelismConfig,
        SyntheticDataConfig,
        TelemetryConfig,
        TrainConfig,
    )

    base = dict(output_path=out, data=SyntheticDataConfig(vocab_size=512), model="tiny-ep", pool="local-2host",
                train_steps=4, tokens_per_step=256, seq_len_phases=((0.0, 32),),
                optimizer=AdamWConfig(warmup_steps=1, peak_lr=1e-2),
                checkpoint=CheckpointPolicy(every_steps=2, every_minutes=None, keep_last=keep_last),
                telemetry=TelemetryConfig(wandb_project=None, progress_every_s=0.0),
                parallelism=ParallelismConfig(param_sharding=param_sharding))
    return TrainConfig(**{**base, **kw})


# A model whose state (about 30M parameters: 360 MB with AdamW) dwarfs the activations of a small
# batch, so a process's memory is dominated by its share of the state: tiny-ep with these fields.
MEMORY_MODEL = {"d_model": 256, "latent_dim": 256, "expert_width": 2048, "n_layers": 2, "vocab_size": 8192,
                "n_heads": 4, "head_dim": 64}
MEMORY_RUN = dict(train_steps=3, tokens_per_step=256, seq_len_phases=((0.0, 16),), keep_last=2)


def main() -> None:
    mode, out, pid, coord = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    hosts = int(sys.argv[5]) if len(sys.argv) > 5 else 2
    expert_width = int(sys.argv[6]) if len(sys.argv) > 6 else 2048  # memory mode: the state's size
    os.environ["JAX_PLATFORMS"] = "cpu"  # before JAX starts its backend: 8 / hosts fake devices per host
    import dataclasses

    from marin.pools import HostContext, get_pool, initialize_jax, with_device_count

    os.environ["XLA_FLAGS"] = with_device_count(os.environ.get("XLA_FLAGS", ""), 8 // hosts)

    pool = get_pool("local-2host")
    if hosts != 2:  # the same (1, 8) mesh over more, smaller hosts
        pool = dataclasses.replace(pool, name=f"local-{hosts}host", hosts=hosts, devices_per_host=8 // hosts)
    ctx = HostContext(pid, hosts, coord, pool)
    initialize_jax(ctx)
    import jax

    jax.block_until_ready(jax.jit(lambda x: x + 1)(jax.numpy.zeros(4)))
    runtime_rss = peak_rss()  # the process with JAX up, before any state exists
    import numpy as np

    from marin.models.config import get_preset
    from marin.parallel.mesh import make_mesh
    from marin.training import checkpoint as ckpt
    from marin.training.trainer import init_state, model_config, state_shapes, state_shardings, train_on_host

    memory_run = {**MEMORY_RUN, "model": get_preset("tiny-ep", **{**MEMORY_MODEL, "expert_width": expert_width}),
                  "preset": "tiny-ep"}
    store_run = dict(train_steps=12, keep_last=2)
    cfgt = config(f"{out}/run", **(memory_run if mode == "memory" else store_run if mode == "store" else {}))
    cfg = model_config(cfgt)
    mesh = make_mesh(*ctx.pool.mesh)
    shardings = state_shardings(state_shapes(cfgt, cfg), mesh, cfgt.parallelism.param_sharding)
    result: dict = {"process": pid}
    if mode == "train":
        # per-host batches: each process builds only its rows; the assembled batch is the whole one
        from jax.experimental import multihost_utils

        from marin.parallel.mesh import batch_sharding
        from marin.training.trainer import host_rows, make_batch_fn, place_batch

        batch_fn, _ = make_batch_fn(cfgt.data)
        rows = host_rows(batch_sharding(mesh), 8, 32)
        result["rows"] = [rows.start, rows.stop]
        same = []
        for step in (0, 1):
            tokens, segments = place_batch(batch_fn, batch_sharding(mesh), step, 8, 32)
            whole = batch_fn(step, 8, 32)
            same.append(all(np.asarray(multihost_utils.process_allgather(x, tiled=True)).tobytes() == whole[k].tobytes()
                            for x, k in ((tokens, "tokens"), (segments, "segment_ids"))))
        result["batch_identical"] = same
        state = init_state(cfgt, cfg, mesh, shardings)
        # no leaf is whole on one process: fsdp and expert leaves hold 1/2 of the rows here
        result["local_fraction"] = sum(s.data.nbytes for x in jax_leaves(state) for s in x.addressable_shards
                                       if s.replica_id == 0) / sum(x.nbytes for x in jax_leaves(state))
        ckpt.write_checkpoint(f"{out}/init", state, {"kind": "fresh"}, step=0)
        del state
        result["summary"] = train_on_host(ctx, cfgt)
    elif mode == "store":
        # what process 0 waits for the other parts (and the others for COMMIT): 8 s, not an hour
        ckpt.CheckpointManager.__init__.__kwdefaults__["part_timeout_s"] = 8.0
        result["summary"] = train_on_host(ctx, cfgt)
    elif mode == "memory":
        # init sharded, 3 training steps with async saves at 2 and 3, then a restore of step 3
        result["summary"] = train_on_host(ctx, cfgt)
        result["peak_after_training"] = peak_rss()
        restored, _ = ckpt.restore_checkpoint(f"{out}/run/checkpoints/step-00000003", state_shapes(cfgt, cfg),
                                              shardings)
        jax.block_until_ready(restored)
        result["state_bytes"] = sum(x.nbytes for x in jax_leaves(restored))
        result["runtime_rss_bytes"] = runtime_rss
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("memory: done")  # process 0 hosts the coordination service
    elif mode == "kill":
        mgr = ckpt.CheckpointManager(f"{out}/run", cfgt.checkpoint, is_writer=pid == 0, part_timeout_s=8)
        state = init_state(cfgt, cfg, mesh, shardings)
        mgr.save(1, state, {"tokens": 0, "data_step": 1}, blocking=True)
        real_commit = ckpt.save._commit

        def commit_or_die(fs, path, data):
            if pid == 1 and "/step-00000002/parts/" in path:
                os.kill(os.getpid(), signal.SIGKILL)  # kill -9 mid-save: chunks written, part record not
            real_commit(fs, path, data)

        ckpt.save._commit = commit_or_die
        mgr.save(2, state, {"tokens": 0, "data_step": 2})
        mgr.wait()  # a failed save is counted, not raised, until checkpoint.max_failed_saves in a row
        result["error"] = mgr.last_failure
    result["peak_rss_bytes"] = peak_rss()
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # the peer may be gone: skip jax.distributed's shutdown barrier


def peak_rss() -> int:
    """VmHWM: this process's own peak (ru_maxrss would carry the parent's over across exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def jax_leaves(tree):
    import jax

    return jax.tree_util.tree_leaves(tree)


if __name__ == "__main__":
    main()
