"""The real multi-host path on CPU: a simulated 2-node Ray cluster, one JAX process per node with 4
fake devices, one 8-device mesh with EP 8 across the process boundary, weights sharded fsdp. The
losses must match a single-process run of the same config, replicated, on the same (1, 8) mesh."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import ray
    from ray.cluster_utils import Cluster
    from marin.training.config import SyntheticDataConfig, TrainConfig
    from marin.training.metrics import read_metrics
    import dataclasses
    from marin.training.pools import RACK_LABEL, get_pool, launch
    from marin.training.trainer import train_on_host

    out = sys.argv[1]
    base = dict(data=SyntheticDataConfig(vocab_size=512), model="tiny-ep", train_steps=4, tokens_per_step=512,
                seq_len_phases=((0.0, 32),), warmup_steps=1, peak_lr=1e-2, checkpoint_every_steps=2,
                checkpoint_every_minutes=None, wandb_project=None, progress_every_s=0.0)

    # no dashboard: nothing here reads it, and its processes take CPU from the hosts' compiles
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1, resources={"fake_host": 4}, labels={RACK_LABEL: "rack-00"})
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    t = time.time()
    # with the rack label, as on GB200: both hosts on distinct nodes of one rack (topology strategy)
    pool = dataclasses.replace(get_pool("local-2host"), rack_label=RACK_LABEL)
    # fsdp on the two hosts (weights and AdamW state split across the process boundary, checkpoints
    # gathered from both), replicated in the twin: the same losses up to float reassociation
    two = launch(pool, train_on_host, (TrainConfig(output_path=out + "/two", pool="local-2host",
                                                   param_sharding="fsdp", **base),))
    t_two = time.time() - t
    # the single-process twin runs as one host on the same cluster (mesh (1, 8) in one process)
    one_config = TrainConfig(output_path=out + "/one", pool="local-cpu-ep8", **base)
    one = launch(get_pool("local-cpu-ep8"), train_on_host, (one_config,))
    print("RESULT " + json.dumps({
        "two": [r["loss"] for r in read_metrics(out + "/two")],
        "one": [r["loss"] for r in read_metrics(out + "/one")],
        "two_drop": [r["drop_frac_send"] for r in read_metrics(out + "/two")],
        "one_drop": [r["drop_frac_send"] for r in read_metrics(out + "/one")],
        "summaries": [two, one], "t_two": t_two}))
    ray.shutdown()
    cluster.shutdown()
    """
)


def test_two_host_cluster_matches_single_process(tmp_path):
    script = tmp_path / "two_hosts.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # each host process gets its own device count from the pool
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "out")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(lines[-1][len("RESULT "):])
    # both hosts returned, host 0 and host 1 each ran the whole loop
    assert len(res["summaries"][0]) == 2 and res["summaries"][0][0]["final_step"] == 4
    assert res["two"] == pytest.approx(res["one"], rel=1e-5)
    assert res["two_drop"] == pytest.approx(res["one_drop"], abs=1e-6)
    assert os.path.exists(tmp_path / "out" / "two" / "checkpoints" / "step-00000004" / "COMMIT")
