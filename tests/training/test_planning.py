"""The memory and compute planner: exact parts against the real state, totals against XLA's own
memory analysis of the same step on CPU, the hero's published schedule, and the CLI."""

import json

import jax
import numpy as np
import pytest

from marin.cli import main
from marin.models.config import count_params, get_preset
from marin.parallel.mesh import make_mesh
from marin.pools import get_pool
from marin.training.config import ParallelismConfig, SyntheticDataConfig, TelemetryConfig, TrainConfig
from marin.training.lowering import abstract_mesh, abstract_state, lower_train_step
from marin.training.planning import (
    StepDoesNotFit,
    activation_bytes_per_token_layer,
    check_train_config_fits,
    memory_plan,
    plan,
    valid_microbatches,
)
from marin.training.trainer import model_config


def _config(model="tiny-ep", overrides=None, pool="local-cpu", tokens=4096, seq_len=64, param_sharding="replicated"):
    """The preset ``model`` with ``overrides`` (MoEConfig fields)."""
    return TrainConfig(output_path="", data=SyntheticDataConfig(), model=get_preset(model, **(overrides or {})),
                       preset=model, pool=pool, tokens_per_step=tokens, seq_len_phases=((0.0, seq_len),),
                       telemetry=TelemetryConfig(wandb_project=None),
                       parallelism=ParallelismConfig(param_sharding=param_sharding))


@pytest.mark.parametrize("param_sharding", ["replicated", "fsdp"])
@pytest.mark.parametrize("pool", ["local-cpu", "gb200-11racks"])
def test_state_parts_are_the_real_per_device_shards(pool, param_sharding):
    """master weights, optimizer state: bytes of the state's per-device shards (abstract for GB200)."""
    config = _config(model="d2048" if pool.startswith("gb200") else "tiny-ep", pool=pool, tokens=704 * 4096,
                     seq_len=4096, param_sharding=param_sharding)
    cfg = model_config(config)
    p = get_pool(pool)
    state, _ = abstract_state(config, cfg, make_mesh(*p.mesh) if p.is_cpu else abstract_mesh(*p.mesh))

    def shard_bytes(tree):
        return sum(int(np.prod(s.sharding.shard_shape(s.shape))) * s.dtype.itemsize for s in jax.tree.leaves(tree))

    mem = memory_plan(cfg, p, config.tokens_per_step, 4096, 1, "fixed", param_sharding)
    assert mem["master_weights"] == shard_bytes(state["params"])
    assert abs(mem["optimizer_state"] - shard_bytes(state["opt_state"])) <= 64  # + Adam's step count


# Small f32 configurations on the 8 fake CPU devices of the test process: the planner's total within
# 15% of XLA's argument + output - aliased + temporary bytes of the compiled step.
VALIDATION = [
    ("local", {}, "local-cpu-1", 2048, 64),
    ("fixed", {"param_sharding": "fsdp"}, "local-cpu", 4096, 64),
    pytest.param("fixed", {"param_sharding": "fsdp", "remat_policy": "full", "d_model": 128, "n_heads": 8,
                           "vocab_size": 4096, "n_layers": 4}, "local-cpu", 8192, 128, marks=pytest.mark.slow),
    pytest.param("fixed", {}, "local-cpu", 4096, 64, marks=pytest.mark.slow),
    pytest.param("local", {"remat_policy": "dots"}, "local-cpu-1", 4096, 128, marks=pytest.mark.slow),
    pytest.param("fixed", {"remat_policy": "full", "d_model": 128, "n_heads": 8}, "local-cpu", 8192, 128,
                 marks=pytest.mark.slow),
    pytest.param("dropless", {"remat_policy": "dots_no_batch", "vocab_size": 4096}, "local-cpu", 4096, 64,
                 marks=pytest.mark.slow),
    # the capacity-bounded ragged transport (on CPU through the emulated collective)
    ("ragged_capacity", {"param_sharding": "fsdp", "n_experts": 16}, "local-cpu", 4096, 64),
    # blocked attention: no [L, L] term, block x block tiles instead
    ("local", {"attention_impl": "blocked", "attention_block": 64}, "local-cpu-1", 2048, 256),
    # a known over-count since the grouped compute's buffers are planned: 1.359 of XLA (1.126 before). The
    # planner adds one layer's capacity buffers (10.5 MB here) to the attention's tiles and the logits;
    # under dots remat with blocked attention XLA does not hold them at its peak. Strict: passes again
    # when the planner learns which transients coincide.
    pytest.param("local", {"attention_impl": "blocked", "attention_block": 128, "remat_policy": "dots"},
                 "local-cpu-1", 4096, 1024,
                 marks=[pytest.mark.slow, pytest.mark.xfail(strict=True, raises=AssertionError,
                                                            reason="the planner sums transients XLA schedules apart "
                                                                   "(1.36x here)")]),
]


@pytest.mark.parametrize("transport,overrides,pool,tokens,seq_len", VALIDATION)
def test_planner_total_within_15_percent_of_xla(transport, overrides, pool, tokens, seq_len):
    overrides = dict(overrides)
    param_sharding = overrides.pop("param_sharding", "replicated")
    config = _config(overrides={"n_layers": 2, **overrides}, pool=pool, tokens=tokens, seq_len=seq_len,
                     param_sharding=param_sharding)
    cfg = model_config(config)
    p = get_pool(pool)
    lowered = lower_train_step(config, cfg, p.mesh, transport, batch_size=tokens // seq_len, seq_len=seq_len,
                               platform="cpu", mesh=make_mesh(*p.mesh))
    ma = lowered.compile().memory_analysis()
    xla = ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
    planned = memory_plan(cfg, p, tokens, seq_len, 1, transport, param_sharding)["total"]
    assert abs(planned - xla) <= 0.15 * xla, (planned, xla)


def test_microbatches_cut_activations_and_the_smallest_fitting_count_is_chosen():
    cfg, pool = get_preset("d2048"), get_pool("gb200-11racks")
    tokens = 11_264 * 4096
    one, four = (memory_plan(cfg, pool, tokens, 4096, m, "fixed") for m in (1, 4))
    assert four["activations"] * 4 == pytest.approx(one["activations"], rel=1e-3)  # capacities round up
    assert four["grads"] == 2 * one["grads"]  # the accumulator
    p = plan(cfg, pool, tokens_per_step=tokens, seq_len=4096, transport="fixed")
    m = p["microbatches"]
    assert p["fits"] and m > 1
    smaller = [c for c in valid_microbatches(tokens // 4096, pool.num_devices) if c < m]
    assert all(memory_plan(cfg, pool, tokens, 4096, c, "fixed")["total"] > p["usable_memory_bytes"] for c in smaller)
    # the dropless transport's worst-case buffers cost far more than the capacity-factor ones
    assert memory_plan(cfg, pool, tokens, 4096, m, "dropless")["all_to_all"] > 10 * p["bytes_per_device"]["all_to_all"]


def test_hero_schedule_and_compute():
    out = []
    rc = main_capture(["plan", "hero", "--pool", "gb200-11racks", "--optimizer", "adamw", "--json"], out)
    p = json.loads(out[0])
    assert p["train_steps"] == 390_139 and p["tokens_per_step"] == 46_137_344
    assert p["train_tokens"] == 390_139 * 46_137_344
    assert p["train_flops"] == pytest.approx(2.7e24, rel=0.05)
    assert "18.00T" in p["warning"] and "18.75T" in p["warning"]
    assert p["mfu"] == 0.21 and p["days"] > 60 and p["device_hours"] == pytest.approx(p["days"] * 24 * 704)
    for key in ("fits", "bytes_per_device", "device_memory_bytes", "microbatches", "train_flops", "device_hours",
                "days"):
        assert key in p
    assert set(p["bytes_per_device"]) >= {"params", "grads", "master_weights", "optimizer_state", "activations",
                                          "all_to_all", "logits", "total"}
    # fsdp by default: the dense weights split 64 ways inside a rack (11 divides none of the hero's
    # dimensions), the routed experts, stored padded to 3080 = 11 x 280, 704 ways (expert x data)
    c = count_params(get_preset("hero"))
    dense = c["total_params"] - c["routed_experts_total"]  # K/V as stored: 12 heads on every layer
    routed_stored = c["stored_params"] - dense
    assert routed_stored == 48 * 384 * 3 * 3072 * 3080
    assert p["param_sharding"] == "fsdp"
    norms = c["norms"]  # vectors stay replicated
    assert p["bytes_per_device"]["master_weights"] == pytest.approx(
        4 * ((dense - norms) / 64 + norms + routed_stored / 704), rel=1e-9)
    # the 4K phase (the schedule's first) fits with the fixed transport
    assert p["fits"] is True and p["microbatches"] == 8 and rc == 0
    # replicated: the dense weights and their AdamW state on every device, 16 bytes per parameter
    out = []
    main_capture(["plan", "hero", "--pool", "gb200-11racks", "--json", "--param-sharding", "replicated"], out)
    r = json.loads(out[0])
    assert r["bytes_per_device"]["master_weights"] > 4 * dense and r["bytes_per_device"]["gathered"] == 0
    assert r["fits"] is False


def main_capture(argv, out):
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    out.append(buf.getvalue())
    return rc


def test_cli_table_and_errors(capsys):
    assert main(["plan", "tiny-ep", "--pool", "local-cpu", "--tokens-per-step", "4096", "--seq-len", "64"]) == 0
    text = capsys.readouterr().out
    for needle in ("master_weights", "optimizer_state", "activations", "all_to_all", "logits", "total", "fits with"):
        assert needle in text
    assert main(["plan", "tiny-ep", "--pool", "local-cpu", "--tokens-per-step", "100", "--seq-len", "64"]) == 2
    assert "tokens per step 100 is not a multiple of seq_len 64 (1.5625 sequences): a step is whole sequences; 512 " \
        "split evenly over 8 devices" in capsys.readouterr().err
    assert main(["plan", "tiny-ep", "--pool", "local-cpu", "--tokens-per-step", "192", "--seq-len", "64"]) == 2
    assert "3 sequences of 64 per step do not split over 8 devices" in capsys.readouterr().err
    assert main(["plan", "tiny-ep", "--pool", "local-cpu", "--transport", "pigeon"]) == 2
    assert "unknown transport 'pigeon'" in capsys.readouterr().err
    assert main(["plan", "tiny-ep", "--pool", "no-such-pool"]) == 2  # a pools file may name any pool: no choices
    err = capsys.readouterr().err
    assert "unknown pool 'no-such-pool'; known: [" in err and "--pools FILE" in err and err.count("\n") == 1


def test_train_config_that_cannot_fit_fails_with_the_table():
    config = _config(model="d2048", pool="h200-1", tokens=64 * 4096, seq_len=4096)
    with pytest.raises(StepDoesNotFit, match="does not fit in device memory") as e:
        check_train_config_fits(config)
    assert "DOES NOT FIT" in str(e.value) and "optimizer_state" in str(e.value)
    assert check_train_config_fits(_config())[0]["fits"]


def test_experiment_file_fails_at_declaration_when_a_step_cannot_fit():
    from experiments.defaults import default_train

    with pytest.raises(StepDoesNotFit, match="h200-1"):
        default_train("x", mixture=SyntheticDataConfig(), model="d2048", pool="h200-1", tokens_per_step=64 * 4096,
                      seq_len_phases=((0.0, 4096),))
    with pytest.warns(UserWarning, match="does not fit"):
        default_train("x", mixture=SyntheticDataConfig(), model="d2048", pool="h200-1", tokens_per_step=64 * 4096,
                      seq_len_phases=((0.0, 4096),), memory_check="warn")
    with pytest.raises(ValueError, match="memory_check must be"):
        default_train("x", mixture=SyntheticDataConfig(), memory_check="maybe")


def test_blocked_attention_removes_the_l_squared_term():
    """Per token and layer, the hero's attention from 4K to 262K: dense grows with L (an [L, L] matrix
    per sequence), blocked stays flat (its tiles shrink per token as L grows)."""
    blocked = get_preset("hero")
    dense = blocked.replace(attention_impl="dense")

    def per_token(cfg, L):
        return sum(activation_bytes_per_token_layer(cfg, L, cfg.top_k).values())

    assert per_token(dense, 65_536) > 8 * per_token(dense, 4096)
    assert per_token(blocked, 262_144) < per_token(blocked, 4096)
    assert per_token(blocked, 65_536) < per_token(dense, 65_536) / 10


@pytest.mark.parametrize("param_sharding", ["replicated", "fsdp"])
@pytest.mark.parametrize("mesh_shape", [(2, 4), (1, 8), (4, 2)])
def test_checkpoint_bytes_per_host_are_the_replica_0_shards_each_host_writes(mesh_shape, param_sharding):
    """Against the slow obvious count: real arrays of the state's shapes placed in the state's
    shardings on 8 devices taken as 2 hosts x 4, and the bytes of the replica-0 shards of params and
    AdamW moments on each host's devices.

    The arrays are zeros put there with ``jax.device_put`` rather than made by ``init_state`` (one
    compile per mesh and sharding, about 12 s each here): ``init_state`` is jitted with these very
    shardings as its ``out_shardings``, and which shards a device holds and their replica ids follow
    from the sharding and the shape alone, not from the values or how they were computed."""
    import dataclasses

    from marin.training.planning import checkpoint_bytes_per_host
    from marin.training.trainer import state_shapes, state_shardings

    config = _config(param_sharding=param_sharding)
    cfg = model_config(config)
    pool = dataclasses.replace(get_pool("local-2host"), mesh=mesh_shape)
    mesh = make_mesh(*mesh_shape)
    shapes = state_shapes(config, cfg)
    state = jax.tree.map(lambda s, sh: jax.device_put(np.zeros(s.shape, s.dtype), sh), shapes,
                         state_shardings(shapes, mesh, param_sharding))
    moments = [x for x in jax.tree.leaves(state["opt_state"]) if x.ndim > 0]  # mu and nu; not the step count
    per_host = [0, 0]
    for leaf in jax.tree.leaves(state["params"]) + moments:
        for s in leaf.addressable_shards:
            if s.replica_id == 0:
                per_host[s.device.id // 4] += s.data.nbytes
    assert checkpoint_bytes_per_host(cfg, pool, param_sharding) == per_host


def test_host_memory_in_the_plan_and_the_hero_fits_on_both():
    out = []
    rc = main_capture(["plan", "hero", "--pool", "gb200-11racks", "--optimizer", "adamw", "--json"], out)
    p = json.loads(out[0])
    for key in ("host_bytes_per_host", "host_memory_bytes", "host_fits", "checkpoint_bytes",
                "checkpoint_bytes_per_host"):
        assert key in p
    assert p["host_memory_bytes"] == 960 * 10**9 and p["hosts"] == 176
    # 535B parameters x 12 bytes (float32 master + two AdamW moments; routed experts stored padded)
    c = count_params(get_preset("hero"))
    assert p["checkpoint_bytes"] == 12 * c["stored_params"] and p["checkpoint_bytes"] > 6.4e12
    # fsdp: the routed experts split over all 704 devices, written 1/176 by every host; the dense
    # weights split 64 ways inside a rack and replicated across the 11 racks, so one replica (rack
    # 0's 16 hosts) writes them; the norms (replicated) go to host 0, the busiest
    # (the dense weights as stored: the global layers' K/V columns padded to the local layers' heads)
    dense = c["total_params"] - c["routed_experts_total"]
    routed = c["stored_params"] - dense
    assert p["checkpoint_bytes_per_host"] == pytest.approx(
        12 * (routed / 176 + (dense - c["norms"]) / 16 + c["norms"]), rel=1e-9)
    assert p["host_bytes"]["resident_state"] == 0 and p["host_bytes_per_host"] < 0.2 * p["host_memory_bytes"]
    assert p["device_fits"] and p["host_fits"] and p["fits"] and rc == 0
    assert p["checkpoint_save_s"] == pytest.approx(p["checkpoint_bytes_per_host"] / 1e9)
    # the table a person reads
    out = []
    main_capture(["plan", "hero", "--pool", "gb200-11racks", "--storage-gbps", "4"], out)
    assert "per host" in out[0] and "checkpoint_staging" in out[0] and "of 894.07 GiB host memory" in out[0]
    assert "written per host by 176 of 176 hosts in parallel" in out[0] and "at 4 GB/s per host" in out[0]


def test_a_run_whose_hosts_cannot_hold_the_checkpoint_staging_does_not_fit():
    from marin.training.planning import plan

    pool = get_pool("gb200-11racks")
    cfg = get_preset("hero")
    # replicated weights: the dense state's one replica is written by host 0 alone
    p = plan(cfg, pool, tokens_per_step=46_137_344, seq_len=4096, param_sharding="replicated",
             host_memory=64 * 2**30)
    assert p["host_fits"] is False and p["fits"] is False
