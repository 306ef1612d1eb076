"""Sampling and evaluation on a pool of several hosts, and the simulated nodes a command line starts
for a local CPU pool: one JAX process per host through the pool launcher, each restoring only its
own slices of the checkpoint; greedy tokens on two hosts equal one device's, token for token."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from marin.cli import main
from marin.data.mixture import MixtureConfig
from marin.execution.jsonable import to_jsonable
from marin.inference.multihost import SampleRequest, sample_on_host
from marin.models.config import get_preset
from marin.models.sampling import Sampling
from marin.models.transformer import init_params, init_router_bias
from marin.pools import get_pool, run_on_pool, simulated_nodes, with_device_count
from marin.training import checkpoint as ckpt
from marin.training.config import TrainConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = ["Council note", "The infra team said that", "x"]


@pytest.fixture(scope="module")
def text_run(k40_data, tmp_path_factory) -> str:
    """A run directory with one committed checkpoint (random weights of an expert-parallel model, 8
    experts) whose record names a token store, so it reads and writes text with that tokenizer."""
    corpus = k40_data.corpus("mh_corpus", total_bytes=40_000, seed=3, domains=("council", "infra"))
    store = k40_data.store("mh_store", corpus, k40_data.tokenizer("mh_tok", corpus, vocab_size=300))
    cfg = get_preset("tiny-ep", vocab_size=300)
    run = str(tmp_path_factory.mktemp("mh") / "train-mh-0123abcd")
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))  # shapes only: no compile
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: (rng.standard_normal(s.shape) * 0.3).astype(s.dtype), shapes)
    bias = (rng.standard_normal(init_router_bias(cfg).shape) * 0.2).astype(np.float32)
    # the record as training writes it (the resolved model, the data, the pool)
    record = to_jsonable(TrainConfig(output_path=run, data=MixtureConfig(stores=(store,), validation_fraction=0.2),
                                     model=cfg, pool="local-cpu-1", seq_len_phases=((0.0, 64),)))
    ckpt.write_checkpoint(f"{run}/checkpoints/{ckpt.step_dirname(5)}",
                          {"params": params, "router_bias": bias}, {"config": record, "tokens": 5000}, step=5)
    return run


def _cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ---- fast: the pieces the two-host path is made of -----------------------------------------------
def test_simulated_nodes_are_one_per_host_and_each_holds_one_hosts_reservation():
    pool = get_pool("local-2host")
    nodes = simulated_nodes(pool)
    assert len(nodes) == pool.hosts
    for node in nodes:  # the launcher's STRICT_SPREAD bundle of one host fits each node, and only one
        offer = {"CPU": node["num_cpus"], **node["resources"]}
        assert all(offer.get(k, 0) >= v for k, v in pool.bundle().items())
        assert all(offer.get(k, 0) < 2 * v for k, v in pool.bundle().items())
    racks = dataclasses.replace(pool, hosts=4, racks=2, mesh=(2, 8), rack_label="marin.io/rack")
    labels = [n["labels"]["marin.io/rack"] for n in simulated_nodes(racks)]
    assert labels == ["rack-00", "rack-00", "rack-01", "rack-01"]
    assert simulated_nodes(get_pool("local-cpu-1")) == []  # the plain local cluster holds a one-host pool
    with pytest.raises(ValueError, match="cannot simulate: pass --address"):
        simulated_nodes(get_pool("gb200-rack"))


def test_the_host_function_on_one_host_equals_decoding_in_this_process(text_run):
    """What every host of a pool runs (restore onto the pool's mesh, decode, process 0 answers),
    here on a one-host pool in this process, against decoding the whole model read directly."""
    from marin.models.decode import generate_tokens

    prompts = [[5, 6, 7, 8], [9, 10], [11]]
    request = SampleRequest(tuple(tuple(p) for p in prompts), 5, Sampling(greedy=True))
    got = run_on_pool(get_pool("local-cpu-1"), sample_on_host, (text_run, None, request))
    model = ckpt.load_model(text_run, None)
    want = generate_tokens(model.params, model.router_bias, model.config, prompts, 5, Sampling(greedy=True))
    assert got.step == 5 and got.tokens == want


def test_a_pool_this_machine_cannot_simulate_is_refused_in_one_line(text_run):
    # a fresh process, as a user's: this one may already be in the test session's Ray cluster, which
    # a command joins instead of simulating nodes
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-m", "marin.cli", "sample", text_run, "--prompt", "hi", "--pool",
                           "gb200-rack"], capture_output=True, text=True, timeout=300, env=env)
    rc, out, err = proc.returncode, proc.stdout, proc.stderr
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert "gb200-rack runs on 16 GB200 host(s), which this machine cannot simulate: pass --address" in err


def test_eval_on_a_real_clusters_pool_refuses_documents_only_this_process_can_read(capsys, text_run, tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"text": "Council note"}\n')
    rc, out, err = _cli(capsys, "eval", text_run, "--pool", "local-2host", "--address", "10.0.0.1:6379",
                        "--data", f"mine={docs}")
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert "--data must name token stores every host can read" in err


@pytest.mark.parametrize("argv,message", [
    (["--pool", "gb200-rack"], "which this machine cannot simulate"),
    (["--pool", "no-such-pool"], "unknown pool 'no-such-pool'"),
    (["--pool", "local-2host", "EXP", "--address", "10.0.0.1:6379"], "with a cluster address (10.0.0.1:6379)"),
])
def test_marin_run_pool_errors_are_one_line(capsys, tmp_path, argv, message):
    exp = tmp_path / "exp.py"
    exp.write_text("from marin.execution import executor_main\nexecutor_main(steps=[])\n")
    argv = [str(exp) if a == "EXP" else a for a in argv]
    if str(exp) not in argv:
        argv.append(str(exp))
    rc, out, err = _cli(capsys, "run", *argv)
    assert rc == 2 and err.startswith("marin: error: ") and err.count("\n") == 1 and message in err, err


# ---- slow: the command line on a simulated two-host pool ------------------------------------------
@pytest.mark.slow
def test_two_host_sample_and_eval_from_the_command_line_equal_one_device(capsys, text_run):
    """`marin sample/eval RUN --pool local-2host` in a fresh process, without --address: it starts two
    simulated nodes (said in one line), runs one JAX process on each (4 fake devices, one (1, 8)
    mesh, experts split across the process boundary) and stops them; the greedy tokens equal one
    device's token for token, the eval numbers up to float reassociation across 8 devices."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["XLA_FLAGS"] = with_device_count(env.get("XLA_FLAGS", ""), None)
    env.update(PYTHONPATH=REPO, RAY_USAGE_STATS_ENABLED="0")
    sample = ["sample", text_run, *[a for p in PROMPTS for a in ("--prompt", p)], "--greedy",
              "--max-new-tokens", "6", "--json"]
    rc, out, err = _cli(capsys, *sample, "--pool", "local-cpu-1")
    assert rc == 0, err
    one = json.loads(out)
    two = subprocess.run([sys.executable, "-m", "marin.cli", *sample, "--pool", "local-2host"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=900)
    assert two.returncode == 0, two.stderr[-4000:]
    note = "marin sample: starting 2 simulated host(s) of pool local-2host as Ray nodes on this machine"
    assert two.stderr.startswith(note) or f"\n{note}" in two.stderr, two.stderr[-2000:]
    got = json.loads(two.stdout)
    assert got["step"] == one["step"] == 5
    assert [s["tokens"] for s in got["samples"]] == [s["tokens"] for s in one["samples"]]
    assert got == one

    rc, out, err = _cli(capsys, "eval", text_run, "--pool", "local-cpu-1", "--json")
    assert rc == 0, err
    want = json.loads(out)
    two = subprocess.run([sys.executable, "-m", "marin.cli", "eval", text_run, "--pool", "local-2host", "--json"],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert two.returncode == 0, two.stderr[-4000:]
    got = json.loads(two.stdout)
    assert got["step"] == 5 and set(got["sets"]) == set(want["sets"])
    for name, m in want["sets"].items():
        assert got["sets"][name]["tokens"] == m["tokens"] and got["sets"][name]["bytes"] == m["bytes"]
        # the same sums, split over 8 devices and two processes instead of one: float32 reassociation
        assert got["sets"][name]["loss"] == pytest.approx(m["loss"], rel=1e-5)
    assert got["macro_bpb"] == pytest.approx(want["macro_bpb"], rel=1e-5)


TWO_HOST_EXPERIMENT = '''
"""One step on local-2host: each host contributes its process id + 1 to a sum over the pool."""
import json
from dataclasses import dataclass

from marin.execution import ExecutorStep, executor_main, this_output_path


def host_sum(ctx):
    import numpy as np
    from jax.experimental import multihost_utils

    return int(np.sum(multihost_utils.process_allgather(np.asarray(ctx.process_id + 1))))


@dataclass(frozen=True)
class SumConfig:
    output_path: str


def pool_sum(config):
    from marin.pools import get_pool, launch

    with open(f"{config.output_path}/sum.json", "w") as f:
        json.dump(launch(get_pool("local-2host"), host_sum), f)


# like a training step, the step's own task holds no CPU the pool's hosts need
step = ExecutorStep(name="two/sum", fn=pool_sum, config=SumConfig(this_output_path()), resources={"num_cpus": 0})
if __name__ == "__main__":
    executor_main(steps=[step])
'''


@pytest.mark.slow
def test_marin_run_with_a_two_host_pool_starts_and_stops_its_simulated_nodes(tmp_path):
    """`marin run --pool local-2host EXP.py` without --address: the step's launch finds two nodes
    (each host a process of its own, joined by jax.distributed), and the run ends with them stopped."""
    exp = tmp_path / "two_host.py"
    exp.write_text(TWO_HOST_EXPERIMENT)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["XLA_FLAGS"] = with_device_count(env.get("XLA_FLAGS", ""), None)
    env.update(PYTHONPATH=REPO, RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.Popen([sys.executable, "-m", "marin.cli", "run", "--pool", "local-2host", str(exp),
                             "--prefix", str(tmp_path / "store"), "--progress", "false"], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stderr[-4000:]
    assert stderr.startswith("marin run: starting 2 simulated host(s) of pool local-2host"), stderr[:500]
    [out] = (tmp_path / "store" / "two").glob("sum-*/sum.json")
    assert json.loads(out.read_text()) == [3, 3]  # both hosts saw both processes: 1 + 2
    assert _processes_of_ray_session_started_by(proc.pid) == []  # every node and agent was stopped


def _processes_of_ray_session_started_by(pid: int) -> list[str]:
    """Command lines of live processes of the Ray session that process ``pid`` started (Ray names a
    session folder ``session_<date>_<time>_<pid of the starter>``)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"_{pid}/" in cmd and "session_" in cmd:
            found.append(cmd[:200])
    return found


@pytest.mark.slow
@pytest.mark.parametrize("command", [["sample", "--prompt", "Council note", "--max-new-tokens", "100"], ["eval"]],
                         ids=["sample", "eval"])
def test_ctrl_c_on_a_two_host_pool_is_rc_130_one_line_and_nothing_left_running(text_run, command):
    """Ctrl-C (twice, as an impatient person does) while the pool's hosts run: the terminal sends
    SIGINT to the whole foreground process group, Ray's processes included. The command stops the
    simulated nodes, agents included, says so in one line and exits with 128 + SIGINT."""
    from marin.execution.reaper import descendants, still_running

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=REPO, RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.Popen([sys.executable, "-m", "marin.cli", command[0], text_run, *command[1:], "--pool",
                             "local-2host"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    before = []
    for line in proc.stderr:  # the hosts are running once they print
        before.append(line)
        if "(_Host" in line:
            break
    started = descendants(proc.pid)  # the nodes, their agents, the hosts, the watchdog
    for _ in range(2):
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.3)
    after = proc.stderr.read()
    proc.wait(timeout=300)
    assert proc.returncode == 128 + signal.SIGINT, "".join(before) + after
    assert [x for x in after.splitlines() if "(_Host" not in x] == [f"marin {command[0]}: stopped (Ctrl-C)"], after
    deadline = time.monotonic() + 10  # the command stopped them before it exited; the kernel reaps them
    while [p for p in started if still_running(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in started if still_running(p)]
