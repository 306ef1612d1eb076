"""The state path at scale, simulated: sharded init whose values do not depend on the mesh or the
process count; two JAX processes that train, save in parallel and survive a kill -9 mid-save;
restores onto other pools (local-2host -> local-cpu -> local-cpu-1) with identical values."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from marin.parallel.mesh import make_mesh
from marin.pools import with_device_count
from marin.training import checkpoint as ckpt
from marin.training.trainer import init_host_state, init_state, model_config, state_shapes, state_shardings

HOST = Path(__file__).with_name("two_process_host.py")
REPO = HOST.parents[2]
sys.path.insert(0, str(HOST.parent))
from two_process_host import config  # noqa: E402  (the hosts' own config, so both sides agree)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(mode: str, out: Path, timeout: float = 600, hosts: int = 2, *extra: str) -> list[dict]:
    """Run the hosts; returns each one's RESULT record (None for a process that died)."""
    coord = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = with_device_count(env.get("XLA_FLAGS", ""), None)
    procs = [subprocess.Popen([sys.executable, str(HOST), mode, str(out), str(p), coord, str(hosts), *extra], env=env,
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for p in range(hosts)]
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        results.append({"rc": p.returncode, "stderr": stderr[-3000:],
                        **(json.loads(lines[-1][7:]) if lines else {})})
    return results


def _leaves_equal(a, b) -> None:
    ka, la, _ = ckpt.flatten_with_keys(a)
    kb, lb, _ = ckpt.flatten_with_keys(b)
    assert ka == kb
    for k, x, y in zip(ka, la, lb, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert x.tobytes() == y.tobytes(), f"{k} differs"


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("two")
    results = _two_processes("train", out)
    assert all(r["rc"] == 0 and "summary" in r for r in results), [r["stderr"] for r in results]
    return out, results


@pytest.mark.slow
def test_init_is_the_same_on_every_mesh_and_process_count(two_process_run):
    out, results = two_process_run
    cfgt = config(str(out / "run"))
    cfg = model_config(cfgt)
    shapes = state_shapes(cfgt, cfg)
    two, meta = ckpt.read_checkpoint(str(out / "init"), template=shapes)
    assert meta == {"kind": "fresh"}
    for mesh_shape, mode in (((1, 8), "fsdp"), ((2, 4), "fsdp"), ((2, 4), "replicated")):
        mesh = make_mesh(*mesh_shape)
        shardings = state_shardings(shapes, mesh, mode)
        _leaves_equal(init_state(cfgt, cfg, mesh, shardings), two)
    _leaves_equal(init_host_state(cfgt, cfg), two)
    # per-host batches: rows 0-3 on process 0, 4-7 on process 1; assembled, the whole batch, bitwise
    assert [r["rows"] for r in results] == [[0, 4], [4, 8]]
    assert all(r["batch_identical"] == [True, True] for r in results)
    # each process held about half of the state, never all of it
    assert all(0.4 < r["local_fraction"] < 0.75 for r in results), [r["local_fraction"] for r in results]


@pytest.mark.slow
def test_two_process_run_resumes_on_one_process_and_evaluates_on_one_device(two_process_run, tmp_path):
    out, results = two_process_run
    assert [r["summary"]["final_step"] for r in results] == [4, 4]
    run = tmp_path / "run"
    shutil.copytree(out / "run", run)
    parts = sorted(p.name for p in (run / "checkpoints" / "step-00000004" / "parts").iterdir())
    assert parts == ["process-00000.json", "process-00001.json"]  # both processes wrote their own shards
    whole, meta = ckpt.read_checkpoint(str(run / "checkpoints" / "step-00000004"))
    assert meta["data_step"] == 4 and meta["config"]["pool"]["name"] == "local-2host"  # the spec, whole

    # restore onto local-cpu (one process, mesh (2, 4), replicated): the same values
    cfgt = config(str(run), pool="local-cpu", param_sharding="replicated")
    cfg = model_config(cfgt)
    shapes = state_shapes(cfgt, cfg)
    mesh = make_mesh(2, 4)
    state, _ = ckpt.restore_checkpoint(str(run / "checkpoints" / "step-00000004"), shapes,
                                       state_shardings(shapes, mesh, "replicated"))
    keys, leaves, _ = ckpt.flatten_with_keys(state)
    for k, leaf in zip(keys, leaves, strict=True):
        assert leaf.sharding.mesh.devices.shape == (2, 4)
        assert np.asarray(leaf).tobytes() == whole[k].tobytes(), k

    # resume the run there: two more steps, from step 4
    from marin.training.trainer import run_training

    summary = run_training(config(str(run), pool="local-cpu", param_sharding="replicated", train_steps=6),
                           use_ray=False)
    assert summary["resumed_from"] == 4 and summary["final_step"] == 6

    # and load the model for inference on one device
    model = ckpt.load_model(str(run), make_mesh(1, 1), step=6)
    assert model.step == 6 and model.config == cfg
    six, _ = ckpt.read_checkpoint(str(run / "checkpoints" / "step-00000006"))
    assert np.asarray(model.params["embed"]).tobytes() == six["['params']['embed']"].tobytes()
    assert np.asarray(model.router_bias).tobytes() == six["['router_bias']"].tobytes()


@pytest.mark.slow
def test_kill_9_of_one_process_mid_save_leaves_the_previous_checkpoint(tmp_path):
    results = _two_processes("kill", tmp_path, timeout=300)
    assert results[1]["rc"] == -9  # SIGKILL
    assert results[0]["rc"] == 0, results[0]["stderr"]
    err = results[0]["error"]
    assert err and "parts process-00001.json did not arrive" in err and "\n" not in err
    root = tmp_path / "run" / "checkpoints"
    assert (root / "step-00000002").exists() and not (root / "step-00000002" / "COMMIT").exists()
    mgr = ckpt.CheckpointManager(str(tmp_path / "run"), config(str(tmp_path)).checkpoint)
    assert mgr.committed_steps() == [1] and ckpt.latest_checkpoint(str(tmp_path / "run")).endswith("step-00000001")
    # the partial one is ignored by readers and deleted before the next attempt trains
    assert mgr.clear_uncommitted() == [2] and not (root / "step-00000002").exists()
    assert mgr.committed_steps() == [1]


@pytest.mark.slow
def test_each_process_holds_a_share_of_the_state_not_all_of_it(tmp_path):
    """Four JAX processes (2 devices each) create the state sharded, train 3 steps with async saves
    and restore the last checkpoint, for a small and a large state (expert width 256 and 2048: 97 MB
    and 361 MB with AdamW). What the larger state adds to each process's peak resident memory stays
    within 4 x its quarter (its shards, their gradients and AdamW update, the save's host staging,
    XLA's temporaries) plus 64 MiB; a path that builds the state on the host or gathers it to save
    adds at least twice the whole difference to every process. (The two runs cancel what does not
    grow with the state: the JAX runtime, compiled programs, the collectives' buffers.)"""
    hosts = 4
    runs = {}
    for width in (256, 2048):
        res = _two_processes("memory", tmp_path / str(width), 900, hosts, str(width))
        assert all(r["rc"] == 0 and "summary" in r for r in res), [r["stderr"] for r in res]
        runs[width] = res
    added_state = runs[2048][0]["state_bytes"] - runs[256][0]["state_bytes"]
    assert added_state > 250e6
    bound = 4 * added_state / hosts + (64 << 20)
    for small, large in zip(runs[256], runs[2048], strict=True):
        added = large["peak_rss_bytes"] - small["peak_rss_bytes"]
        assert added < bound, (large["process"], added / 1e6, bound / 1e6)
    assert bound < 2 * added_state
