"""Pools as data: the shipped inventory file, pools files of one's own (``--pools FILE``,
``MARIN_POOLS``), a PoolSpec passed where a pool name is accepted, and what a bad file says."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from marin.cli import main as marin
from marin.pools import POOLS, PoolsFileError, PoolSpec, as_pool, get_pool, read_pools_file
from marin.pools import spec as P

REPO = Path(__file__).resolve().parents[2]

MY_POOLS = textwrap.dedent(
    """
    # a site of one's own: 4 nodes of 8 H100, and a CPU pool to try things on
    [pools.h100-4x8]
    hosts = 4
    devices_per_host = 8
    accelerator = "H100"
    mesh = [4, 8]
    device_resource = "GPU"
    host_memory_bytes = 2_000_000_000_000

    [pools.file-cpu]
    hosts = 1
    devices_per_host = 2
    accelerator = "cpu"
    mesh = [1, 2]
    """
)


@pytest.fixture()
def pools_registry():
    """POOLS, the accelerators and ``MARIN_POOLS`` as before the test, again after it (declaring pools
    changes them; ``--pools`` sets ``MARIN_POOLS`` itself, which monkeypatch would not undo)."""
    env = os.environ.pop(P.POOLS_ENV, None)
    before, memory, read = dict(POOLS), dict(P.ACCELERATOR_MEMORY_BYTES), list(P.ENV_FILES_READ)
    yield
    os.environ.pop(P.POOLS_ENV, None)
    if env is not None:
        os.environ[P.POOLS_ENV] = env
    POOLS.clear()
    POOLS.update(before)
    P.ACCELERATOR_MEMORY_BYTES.clear()
    P.ACCELERATOR_MEMORY_BYTES.update(memory)
    P.ENV_FILES_READ[:] = read


def test_the_shipped_file_reads_the_same_through_the_checked_path_and_keeps_the_numbers():
    pools, memory = read_pools_file(P.SHIPPED_POOLS_FILE)
    assert pools == {n: POOLS[n] for n in P.SHIPPED_POOL_NAMES} and memory == P.ACCELERATOR_MEMORY_BYTES
    rack, hero, h200 = POOLS["gb200-rack"], POOLS["gb200-11racks"], POOLS["h200-1"]
    assert (rack.hosts, rack.devices_per_host, rack.mesh, rack.host_memory_bytes) == (16, 4, (1, 64), 960 * 10**9)
    assert (hero.hosts, hero.racks, hero.num_devices, hero.mesh) == (176, 11, 704, (11, 64))
    assert h200.host_memory_bytes == 128 * (1 << 30) and P.RACK_LABEL == rack.rack_label == "marin.io/rack"
    assert P.ACCELERATOR_MEMORY_BYTES == {"GB200": 189_471 << 20, "B200": 183_359 << 20, "H200": 143_771 << 20,
                                          "H100": 81_559 << 20}


def test_a_pools_file_declares_its_pools_by_name(tmp_path, pools_registry):
    path = tmp_path / "site.toml"
    path.write_text(MY_POOLS)
    [h100, cpu] = P.load_pools_file(str(path))
    assert get_pool("h100-4x8") is h100 and (h100.num_devices, h100.mesh) == (32, (4, 8))
    assert get_pool("file-cpu") == cpu
    P.load_pools_file(str(path))  # the same file again: the same pools, nothing refused
    with pytest.raises(PoolsFileError, match=r"pools\.local-cpu: pool 'local-cpu' is already declared.*shipped"):
        other = tmp_path / "clash.toml"
        other.write_text('[pools.local-cpu]\nhosts = 1\ndevices_per_host = 1\naccelerator = "cpu"\nmesh = [1, 1]\n')
        P.load_pools_file(str(other))


def test_marin_pools_is_read_on_the_first_unknown_name(tmp_path, monkeypatch, pools_registry):
    path = tmp_path / "site.toml"
    path.write_text(MY_POOLS)
    with pytest.raises(KeyError, match="--pools FILE or MARIN_POOLS"):
        get_pool("file-cpu")
    monkeypatch.setenv(P.POOLS_ENV, str(path))
    assert get_pool("file-cpu").mesh == (1, 2)


def test_a_spec_a_name_and_a_recorded_spec_are_one_pool():
    from marin.execution.jsonable import to_jsonable

    spec = POOLS["gb200-rack"]
    assert as_pool(spec) is spec and as_pool("gb200-rack") is spec and get_pool("gb200-rack") is spec
    assert as_pool(to_jsonable(spec)) == spec  # a run's record holds the spec it was given, as JSON
    with pytest.raises(TypeError, match="a PoolSpec is used as it is"):
        get_pool(spec)  # past the edges a pool travels as its spec; a name is looked up only where one is given


def test_a_users_pool_with_a_shipped_name_and_other_values_is_refused_in_one_line(offline_k40):
    """A name means one pool everywhere (marin plan, the records, their readers): a PoolSpec that takes
    a shipped pool's name with other values is refused where it is given; the same values are that pool."""
    import dataclasses

    from experiments.defaults import default_eval, default_train
    from marin.training.config import SyntheticDataConfig

    imposter = dataclasses.replace(POOLS["local-cpu"], hosts=2, mesh=(4, 4))
    with pytest.raises(ValueError) as e:
        default_train("t", mixture=SyntheticDataConfig(vocab_size=512), model="tiny", pool=imposter)
    assert str(e.value) == ("pool 'local-cpu' is one of marin's shipped pools, and this PoolSpec differs from it "
                            "(hosts=2, mesh=(4, 4)): give yours another name")
    same = dataclasses.replace(POOLS["local-cpu"])
    train = default_train("t", mixture=SyntheticDataConfig(vocab_size=512), model="tiny", pool=same)
    assert train.config.pool == POOLS["local-cpu"]
    with pytest.raises(ValueError, match="is one of marin's shipped pools"):
        default_eval("t-eval", train, held_out=True, pool=imposter)
    with pytest.raises(ValueError, match="already declared, with other values, by marin's shipped pools"):
        P.declare_pool(imposter)  # a pools file's table of that name is refused the same way


def test_a_pool_passed_by_value_leaves_the_step_hash_alone(offline_k40):
    """The pool is where a step runs, not what it computes (live): a spec, its name, or a user's pool
    of the same shape give one hash."""
    from experiments.defaults import default_eval, default_harness_eval, default_train
    from marin.execution import plan_steps
    from marin.training.config import AdamWConfig, SyntheticDataConfig, TelemetryConfig

    def train(pool):
        return default_train("t", mixture=SyntheticDataConfig(vocab_size=512), model="tiny", pool=pool,
                             train_steps=2, optimizer=AdamWConfig(warmup_steps=1), tokens_per_step=128,
                             seq_len_phases=((0.0, 16),), telemetry=TelemetryConfig(wandb_project=None))

    def hashes(pool):
        t = train(pool)
        e = default_eval("t-eval", t, held_out=False, tasks={"toy": "/tasks/toy.jsonl"}, pool=pool)
        h = default_harness_eval("t-harness", t, ["toy"], pool=pool)
        assert e.config.pool == h.config.pool == t.config.pool  # each step carries the spec itself
        return [s.hash for s in plan_steps([t, e, h], "/p").steps]

    mine = PoolSpec("my-cpu", hosts=1, devices_per_host=8, accelerator="cpu", mesh=(2, 4))
    assert hashes("local-cpu") == hashes(POOLS["local-cpu"]) == hashes(mine)
    step = train(mine)
    assert step.config.pool is mine and "on my-cpu" in step.description
    assert train("local-cpu").config.pool is POOLS["local-cpu"]  # a name is resolved once, where the config is built


def test_a_user_pool_of_another_accelerator_plans_with_its_own_device_memory():
    from marin.models.config import get_preset
    from marin.training.planning import device_memory_bytes, plan

    odd = PoolSpec("a100-2", hosts=1, devices_per_host=2, accelerator="A100", mesh=(1, 2),
                   device_memory_bytes=80 * 10**9, host_memory_bytes=10**12)  # A100: no memory in the inventory
    assert device_memory_bytes(odd) == 80 * 10**9
    p = plan(get_preset("tiny"), odd, tokens_per_step=2 * 16 * 64, seq_len=64)
    assert p["pool"] == "a100-2" and p["fits"]


def _where(ctx):
    import jax

    return {"pool": ctx.pool.name, "devices": jax.device_count(), "pid": os.getpid()}


def test_a_pool_of_ones_own_naming_launches_its_hosts(ray_local):
    """The fast core of the end-to-end run below: the launcher takes the spec a step was given."""
    import ray.cloudpickle

    from marin.pools import launch
    from marin.training.config import SyntheticDataConfig, TrainConfig

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this module
    mine = PoolSpec("my-cpu", hosts=1, devices_per_host=2, accelerator="cpu", mesh=(1, 2))
    config = TrainConfig(output_path="/unused", data=SyntheticDataConfig(vocab_size=512), model="tiny", pool=mine)
    [host] = launch(config.pool, _where)
    assert host["pool"] == "my-cpu" and host["devices"] == 2 and host["pid"] != os.getpid()


BAD_FILES = {
    "wrong type": ('[pools.x]\nhosts = "two"\ndevices_per_host = 1\naccelerator = "cpu"\nmesh = [1, 1]\n',
                   r"pools\.x\.hosts: Couldn't parse 'two' into an int"),
    "unknown field": ('[pools.x]\nhostz = 1\nhosts = 1\ndevices_per_host = 1\naccelerator = "cpu"\nmesh = [1, 1]\n',
                      r"pools\.x: The fields `hostz` are not valid"),
    "missing field": ('[pools.x]\nhosts = 1\naccelerator = "cpu"\nmesh = [1, 1]\n',
                      r"pools\.x: Missing required field\(s\) `devices_per_host`"),
    "mesh": ('[pools.x]\nhosts = 2\ndevices_per_host = 4\naccelerator = "cpu"\nmesh = [2, 2]\n',
             r"pools\.x: mesh \(2, 2\) has 4 devices, pool has 2 x 4 = 8"),
    "accelerator": ('[pools.x]\nhosts = 1\ndevices_per_host = 8\naccelerator = "MI300X"\nmesh = [1, 8]\n',
                    r"pools\.x\.device_memory_bytes: needed for accelerator 'MI300X'"),
    "section": ('[pool.x]\nhosts = 1\n', r"unknown section \[pool\]"),
    "not toml": ('[pools.x\nhosts = 1\n', r"not TOML: "),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_pools_file_is_one_line_naming_the_file_and_the_field(case, tmp_path, capsys, pools_registry):
    text, expected = BAD_FILES[case]
    path = tmp_path / "bad.toml"
    path.write_text(text)
    assert marin(["plan", "tiny", "--pool", "x", "--pools", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"marin plan: error: pools file {path}: ") and err.count("\n") == 1, err
    assert re.search(expected, err), err


def test_marin_plan_plans_a_pool_of_a_pools_file(tmp_path, capsys, pools_registry):
    path = tmp_path / "site.toml"
    path.write_text(MY_POOLS)
    assert marin(["plan", "tiny", "--pool", "h100-4x8", "--pools", str(path), "--json"]) == 0
    out = capsys.readouterr().out
    assert '"pool": "h100-4x8"' in out and '"devices": 32' in out
    assert P.POOLS_ENV not in os.environ  # the processes it starts get the spec in their config, not a file
    assert marin(["plan", "tiny", "--pool", "nope", "--pools", str(path)]) == 2
    assert "unknown pool 'nope'" in capsys.readouterr().err


USER_POOL_EXPERIMENT = textwrap.dedent(
    """
    from experiments.defaults import default_train
    from marin.execution import executor_main
    from marin.training.config import AdamWConfig, SyntheticDataConfig, TelemetryConfig
    from marin.pools import PoolSpec

    # a pool of this experiment's own, passed to the step itself
    MY_CPU = PoolSpec("my-cpu", hosts=1, devices_per_host=2, accelerator="cpu", mesh=(1, 2))


    def train(name, pool):
        return default_train(name, mixture=SyntheticDataConfig(vocab_size=512), model="tiny", pool=pool,
                             train_steps=2, optimizer=AdamWConfig(warmup_steps=1), tokens_per_step=2 * 2 * 16,
                             seq_len_phases=((0.0, 16),), telemetry=TelemetryConfig(wandb_project=None))


    steps = [train("mine/by-value", MY_CPU), train("mine/by-name", "file-cpu")]  # the latter: --pools FILE
    if __name__ == "__main__":
        executor_main(steps=steps)
    """
)


def _cli(args, tmp_path, **env):
    full = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", **env}
    full.pop(P.POOLS_ENV, None)
    return subprocess.run([sys.executable, "-m", "marin.cli", *args], capture_output=True, text=True, env=full,
                          cwd=tmp_path, timeout=600)


def test_marin_run_with_a_bad_pools_file_says_so_in_one_line(tmp_path):
    exp = tmp_path / "exp.py"
    exp.write_text(USER_POOL_EXPERIMENT)
    bad = tmp_path / "bad.toml"
    bad.write_text('[pools.file-cpu]\nhosts = 0\ndevices_per_host = 8\naccelerator = "cpu"\nmesh = [0, 8]\n')
    r = _cli(["run", "--pools", str(bad), str(exp), "--dry_run", "true"], tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"marin run: error: pools file {bad}: pools.file-cpu: hosts, devices_per_host and racks must be positive"
    ], r.stderr


@pytest.mark.slow  # two tiny training runs through a fresh local Ray cluster (317 s on the busy 2-core VM)
def test_a_pool_declared_in_an_experiment_file_and_one_from_a_pools_file_plan_and_run(tmp_path):
    exp = tmp_path / "exp.py"
    exp.write_text(USER_POOL_EXPERIMENT)
    site = tmp_path / "site.toml"
    site.write_text(MY_POOLS)
    store = tmp_path / "store"
    dry = _cli(["run", "--pools", str(site), str(exp), "--prefix", str(store), "--dry_run", "true"], tmp_path)
    assert dry.returncode == 0, dry.stderr[-2000:]
    r = _cli(["run", "--pools", str(site), str(exp), "--prefix", str(store), "--progress", "false"], tmp_path)
    assert r.returncode == 0 and "Steps: 2 succeeded" in r.stderr, r.stderr[-3000:]
    for name in ("by-value", "by-name"):
        [run_dir] = (store / "mine").glob(f"{name}-*")
        assert (run_dir / "metrics.jsonl").read_text().count("\n") >= 1
