"""The stall watchdog on the real multi-host path: a simulated 2-node Ray cluster trains ``local-2host``
(one JAX process per node, EP 8 across the process boundary); host 1 is frozen with SIGSTOP mid-training,
so host 0 waits for it inside a collective and nothing fails by itself. The launcher must see that no
step completes, name host 1, kill the pool, relaunch it from the last checkpoint and finish, with one
metrics record per step."""

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
    import dataclasses, json, os, signal, sys, time
    import ray
    import ray.cloudpickle
    from ray.cluster_utils import Cluster
    from marin.training.config import (AdamWConfig, CheckpointPolicy, StallRule, SyntheticDataConfig,
                                       TelemetryConfig, TrainConfig)
    from marin.training.metrics import read_metrics
    from marin.pools import get_pool, launch
    from marin.training.trainer import STALLS_FILE, train_on_host

    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    STOP_AT = 5

    def train_then_freeze_host_1(ctx, config, marker):
        # the first attempt: host 1 freezes (SIGSTOP, by the kernel) right after it completed step STOP_AT
        from marin.training import trainer

        if ctx.process_id == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            real = trainer.report_step

            def report_then_freeze(step, seconds):
                real(step, seconds)
                if step == STOP_AT:
                    with open(marker, "w") as f:
                        json.dump({"pid": os.getpid(), "time": time.time()}, f)
                    os.kill(os.getpid(), signal.SIGSTOP)

            trainer.report_step = report_then_freeze
        return train_on_host(ctx, config)

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(2):
        cluster.add_node(num_cpus=1, resources={"fake_host": 4})
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    config = TrainConfig(output_path=out + "/run", pool="local-2host", data=SyntheticDataConfig(vocab_size=512),
                         model="tiny-ep", train_steps=10, tokens_per_step=512, seq_len_phases=((0.0, 32),),
                         optimizer=AdamWConfig(warmup_steps=1),
                         checkpoint=CheckpointPolicy(every_steps=3, every_minutes=None),
                         telemetry=TelemetryConfig(wandb_project=None, progress_every_s=0.0),
                         stall=StallRule(timeout_s=8.0, startup_s=300.0))
    pool = dataclasses.replace(get_pool("local-2host"), max_retries=1)
    t = time.time()
    summaries = launch(pool, train_then_freeze_host_1, (config, out + "/frozen"), stall=config.stall,
                       stall_log=config.output_path + "/" + STALLS_FILE)
    with open(config.output_path + "/" + STALLS_FILE) as f:
        stalls = json.load(f)
    with open(out + "/frozen") as f:
        frozen = json.load(f)
    print("RESULT " + json.dumps({"steps": [r["step"] for r in read_metrics(config.output_path)],
                                  "summaries": summaries, "stalls": stalls, "frozen": frozen,
                                  "wall_s": time.time() - t}))
    ray.shutdown()
    cluster.shutdown()
    """
)


@pytest.mark.slow  # a 2-node cluster, two pool attempts each compiling the step: about a minute or more
def test_a_host_frozen_mid_training_is_detected_and_the_run_finishes_from_its_checkpoint(tmp_path):
    script = tmp_path / "stall.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = with_device_count(env.get("XLA_FLAGS", ""), None)  # each host process gets its own from the pool
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "out")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(lines[-1][len("RESULT "):])
    # finished on the relaunch, from the step-3 checkpoint, with every step's metrics once
    assert [s["final_step"] for s in res["summaries"]] == [10, 10]
    assert [s["resumed_from"] for s in res["summaries"]] == [3, 3]
    assert res["steps"] == list(range(1, 11))
    # the stall was found once, after the frozen host's last step, within a look at the board of the timeout
    [stall] = res["stalls"]
    assert stall["attempt"] == 1 and stall["last_step"] == 5
    assert 8.0 <= stall["idle_s"] < 8.0 + 10.0  # (recorded to 0.1 s)
    # the frozen host is the one named behind; host 0 (waiting for it in the collective) is not
    assert len(stall["behind"]) == 1, stall
    assert stall["behind"][0].startswith(f"host 1 (pid {res['frozen']['pid']} ") and "silent for" in stall["behind"][0]
    assert any(h.startswith("host 0 ") and "alive" in h for h in stall["hosts"]), stall["hosts"]
