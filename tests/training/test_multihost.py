"""The real multi-host path on CPU: a simulated 2-node Ray cluster, one JAX process per node with 4
fake devices, one 8-device mesh with EP 8 across the process boundary, weights sharded fsdp. The
losses must match a single-process run of the same config, replicated, on the same (1, 8) mesh: the
test's own process (8 fake devices) trains that twin while the cluster starts and trains."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from marin.pools import with_device_count

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import ray
    from ray.cluster_utils import Cluster
    from marin.training.config import train_config_from_record
    from marin.training.metrics import read_metrics
    import dataclasses
    from marin.pools import RACK_LABEL, get_pool, launch
    from marin.training.trainer import train_on_host

    config = train_config_from_record(json.loads(sys.argv[1]))  # the test's config, as a run records it

    # no dashboard: nothing here reads it, and its processes take CPU from the hosts' compiles
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1, resources={"fake_host": 4}, labels={RACK_LABEL: "rack-00"})
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    t = time.time()
    # with the rack label, as on GB200: both hosts on distinct nodes of one rack (topology strategy)
    pool = dataclasses.replace(config.pool, rack_label=RACK_LABEL)
    two = launch(pool, train_on_host, (config,))
    t_two = time.time() - t
    print("RESULT " + json.dumps({
        "loss": [r["loss"] for r in read_metrics(config.output_path)],
        "drop": [r["drop_frac_send"] for r in read_metrics(config.output_path)],
        "summaries": two, "t_two": t_two}))
    ray.shutdown()
    cluster.shutdown()
    """
)


def test_two_host_cluster_matches_single_process(tmp_path):
    from marin.execution.jsonable import mask_secrets
    from marin.training.config import (
        AdamWConfig,
        CheckpointPolicy,
        ParallelismConfig,
        SyntheticDataConfig,
        TelemetryConfig,
        TrainConfig,
    )
    from marin.training.metrics import read_metrics
    from marin.training.trainer import run_training

    base = dict(data=SyntheticDataConfig(vocab_size=512), model="tiny-ep", train_steps=4, tokens_per_step=512,
                seq_len_phases=((0.0, 32),), optimizer=AdamWConfig(warmup_steps=1, peak_lr=1e-2),
                checkpoint=CheckpointPolicy(every_steps=2, every_minutes=None),
                telemetry=TelemetryConfig(wandb_project=None, progress_every_s=0.0))
    # fsdp on the two hosts (weights and AdamW state split across the process boundary, checkpoints
    # gathered from both), replicated in the twin: the same losses up to float reassociation
    two = TrainConfig(output_path=str(tmp_path / "out" / "two"), pool="local-2host",
                      parallelism=ParallelismConfig(param_sharding="fsdp"), **base)
    script = tmp_path / "two_hosts.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = with_device_count(env.get("XLA_FLAGS", ""), None)  # each host process gets its own from the pool
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, str(script), json.dumps(mask_secrets(two))], env=env,
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # the single-process twin: the same config as one host with all 8 devices, in this process
        one = run_training(TrainConfig(output_path=str(tmp_path / "one"), pool="local-cpu-ep8", **base),
                           use_ray=False)
        stdout, stderr = proc.communicate(timeout=900)
    finally:
        proc.kill()
    lines = [l for l in stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, stdout[-4000:] + stderr[-4000:]
    res = json.loads(lines[-1][len("RESULT "):])
    # both hosts returned, host 0 and host 1 each ran the whole loop
    assert len(res["summaries"]) == 2 and res["summaries"][0]["final_step"] == 4 == one["final_step"]
    assert res["loss"] == pytest.approx([r["loss"] for r in read_metrics(str(tmp_path / "one"))], rel=1e-5)
    assert res["drop"] == pytest.approx([r["drop_frac_send"] for r in read_metrics(str(tmp_path / "one"))],
                                        abs=1e-6)
    assert os.path.exists(tmp_path / "out" / "two" / "checkpoints" / "step-00000004" / "COMMIT")
