"""FSDP (param_sharding="fsdp"): the layout rule, the state really sharded on the 8 fake devices, the
same training as the replicated layout up to float summation order, checkpoints that restore into
either layout, and the planner's leaf-by-leaf accounting."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin.models.config import count_params, get_preset, param_shapes
from marin.models.transformer import init_params
from marin.parallel.layout import leaf_partition, shard_shape
from marin.parallel.mesh import batch_sharding, make_mesh, place_host_arrays
from marin.parallel.roles import DENSE_MATRIX, EMBEDDING, EXPERT_STACK, VECTOR
from marin.pools import get_pool
from marin.training.checkpoint import CheckpointManager, CheckpointPolicy
from marin.training.config import ParallelismConfig, SyntheticDataConfig, TelemetryConfig, TrainConfig
from marin.training.planning import memory_plan, params_per_device
from marin.training.trainer import (
    init_host_state,
    make_train_step,
    model_config,
    state_shardings,
    synthetic_batch,
)


def test_param_shapes_match_init_params():
    for name in ("tiny-ep", "hero"):
        cfg = get_preset(name, n_layers=2)
        shapes = jax.eval_shape(lambda k, c=cfg: init_params(c, k), jax.random.PRNGKey(0))
        flat = {"/".join(str(k.key) for k in path): tuple(leaf.shape)
                for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]}
        assert flat == param_shapes(cfg)


def test_layout_rule():
    # the whole mesh divides the largest non-layer dimension: split over both axes
    assert leaf_partition(DENSE_MATRIX, (4, 64, 128), (2, 4), "fsdp", True) == (None, None, ("data", "expert"))
    # the layer axis is never split, even when it is the only divisible one
    assert leaf_partition(DENSE_MATRIX, (8, 6, 10), (2, 4), "fsdp", True) == (None, None, "data")
    # the hero's 11 x 64 mesh: nothing divides by 704, so "expert" (inside a rack) alone
    assert leaf_partition(DENSE_MATRIX, (48, 6144, 6144), (11, 64), "fsdp", True) == (None, "expert", None)
    assert leaf_partition(EMBEDDING, (128256, 6144), (11, 64), "fsdp", False) == ("expert", None)
    # norm scales and scalars stay replicated; so does everything under "replicated" but experts
    assert leaf_partition(VECTOR, (4, 64), (2, 4), "fsdp", True) == (None, None)
    assert leaf_partition(VECTOR, (), (2, 4), "fsdp", False) == ()
    assert leaf_partition(DENSE_MATRIX, (4, 64, 128), (2, 4), "replicated", True) == (None, None, None)
    # routed experts: expert axis over "expert", the largest other divisible dimension over "data"
    assert leaf_partition(EXPERT_STACK, (4, 8, 32, 64), (2, 4), "replicated", True) == (None, "expert", None, None)
    assert leaf_partition(EXPERT_STACK, (4, 8, 32, 64), (2, 4), "fsdp", True) == (None, "expert", None, "data")
    assert leaf_partition(EXPERT_STACK, (48, 384, 3072, 3072), (11, 64), "fsdp", True) == (None, "expert", None, None)
    # the hero preset pads its expert width to 3080 = 11 x 280: the experts split over the 11 racks too
    hero = param_shapes(get_preset("hero"))
    assert leaf_partition(EXPERT_STACK, hero["blocks/expert_up"], (11, 64), "fsdp", True) == (
        None, "expert", None, "data")
    assert leaf_partition(EXPERT_STACK, hero["blocks/expert_down"], (11, 64), "fsdp", True) == (
        None, "expert", "data", None)
    assert shard_shape((4, 8, 32, 64), (None, "expert", None, "data"), (2, 4)) == (4, 2, 32, 32)
    with pytest.raises(ValueError, match="unknown param_sharding 'zero'"):
        leaf_partition(DENSE_MATRIX, (4, 64, 128), (2, 4), "zero", True)
    with pytest.raises(ValueError, match="unknown param_sharding 'zero'"):
        TrainConfig(output_path="", data=SyntheticDataConfig(), parallelism=ParallelismConfig(param_sharding="zero"))


def _config(mode):
    # one layer: the layer axis is never split, and XLA drops a one-step scan's loop (faster compiles)
    return TrainConfig(output_path="", data=SyntheticDataConfig(), model=get_preset("tiny-ep", n_layers=1),
                       tokens_per_step=64 * 32, seq_len_phases=((0.0, 32),),
                       telemetry=TelemetryConfig(wandb_project=None),
                       parallelism=ParallelismConfig(param_sharding=mode))


def _steps(config, mesh, state, shardings, start, n, transport="fixed"):
    cfg = model_config(config)
    step = make_train_step(config, cfg, mesh, transport, shardings)
    out = []
    for i in range(start, start + n):
        b = synthetic_batch(config.data, i, 64, 32)
        s = batch_sharding(mesh)
        state, m = step(state, *place_host_arrays((b["tokens"], b["segment_ids"]), s), jnp.float32(3e-3))
        out.append({k: float(v) for k, v in m.items()})
    return out, state


@pytest.fixture(scope="module")
def fresh_host_state():
    """The fresh state on the host, made once for the module (its jit takes seconds to compile): it is
    a function of the seed and the model only, the same for either layout (param_sharding only decides
    where the leaves are placed). Tests place copies of it."""
    config = _config("replicated")
    return init_host_state(config, model_config(config))


def _copy(host):
    return jax.tree.map(np.copy, host)  # the step donates its state: never hand it the shared arrays


def _start(mode, mesh, host):
    config = _config(mode)
    shardings = state_shardings(host, mesh, mode)
    return config, place_host_arrays(_copy(host), shardings), shardings


def test_fsdp_state_is_sharded_and_trains_like_replicated(tmp_path, fresh_host_state):
    mesh = make_mesh(2, 4)
    rep_cfg, rep_state, rep_sh = _start("replicated", mesh, fresh_host_state)
    fsdp_cfg, fsdp_state, fsdp_sh = _start("fsdp", mesh, fresh_host_state)

    # every weight matrix and its AdamW moments hold 1/8 of the leaf per device (experts: 1/4 x 1/2)
    blocks, mu = fsdp_state["params"]["blocks"], fsdp_state["opt_state"][1].mu["blocks"]
    for leaf in (blocks["wq"], blocks["shared_up"], fsdp_state["params"]["embed"], blocks["expert_up"], mu["wo"]):
        shard = leaf.addressable_shards[0].data.shape
        assert np.prod(shard) * 8 == np.prod(leaf.shape), (leaf.shape, shard, leaf.sharding)
    assert blocks["attn_norm"].sharding.is_fully_replicated
    assert rep_state["params"]["blocks"]["wq"].sharding.is_fully_replicated

    rep, rep_state = _steps(rep_cfg, mesh, rep_state, rep_sh, 0, 3)
    fsdp, fsdp_state = _steps(fsdp_cfg, mesh, fsdp_state, fsdp_sh, 0, 3)
    # the same math; only where partial sums are added differs (f32: a few ulps, amplified a little
    # by AdamW's per-element normalisation of near-zero gradients)
    for a, b in zip(rep, fsdp):
        for key in ("loss", "ce_loss", "z_loss", "grad_norm", "drop_frac_send", "drop_frac_recv"):
            np.testing.assert_allclose(b[key], a[key], rtol=2e-5, atol=1e-6, err_msg=key)
    assert fsdp[-1]["loss"] < fsdp[0]["loss"]
    # AdamW divides each update by sqrt(nu): an element whose gradient is near zero turns ulp-level
    # differences of the gradient into a visible fraction of one LR step (3e-3 here); allow 2% of it
    for x, y in zip(jax.tree.leaves(jax.device_get(rep_state)), jax.tree.leaves(jax.device_get(fsdp_state))):
        np.testing.assert_allclose(y, x, rtol=1e-4, atol=0.02 * 3e-3)
    # the step keeps the layout it was given (no silent re-gather of the state)
    assert fsdp_state["params"]["blocks"]["wq"].sharding == fsdp_sh["params"]["blocks"]["wq"]

    # checkpoint round trip: saved whole, restored into either layout, training continues identically
    ckpts = CheckpointManager(str(tmp_path), CheckpointPolicy(every_steps=1, every_minutes=None, keep_last=1))
    ckpts.save(3, fsdp_state, {"tokens": 3 * 2048})
    ckpts.wait()  # saves are asynchronous: restore once this one is committed
    step, host, _ = ckpts.restore_latest(template=fresh_host_state)
    assert step == 3
    for x, y in zip(jax.tree.leaves(jax.device_get(fsdp_state)), jax.tree.leaves(host)):
        np.testing.assert_array_equal(x, y)
    cont_fsdp, _ = _steps(fsdp_cfg, mesh, place_host_arrays(host, fsdp_sh), fsdp_sh, 3, 1)
    cont_rep, _ = _steps(rep_cfg, mesh, place_host_arrays(host, rep_sh), rep_sh, 3, 1)
    np.testing.assert_allclose(cont_rep[0]["loss"], cont_fsdp[0]["loss"], rtol=2e-5)


@pytest.mark.parametrize("transport", ["dropless", pytest.param("ragged", marks=pytest.mark.slow),
                                       pytest.param("local", marks=pytest.mark.slow)])
def test_every_transport_trains_the_same_under_fsdp(transport, fresh_host_state):
    """The EP shard_maps take expert weights split over "expert" only: fsdp's "data" split is
    gathered at their boundary, and the step computes what the replicated layout computes."""
    mesh = make_mesh(2, 4)
    runs = {}
    for mode in ("replicated", "fsdp"):
        config, state, shardings = _start(mode, mesh, fresh_host_state)
        runs[mode], _ = _steps(config, mesh, state, shardings, 0, 2, transport)
    for a, b in zip(runs["replicated"], runs["fsdp"]):
        for key in ("loss", "grad_norm", "drop_frac_send"):
            np.testing.assert_allclose(b[key], a[key], rtol=2e-5, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("pool,model", [("local-cpu", "tiny-ep"), ("gb200-rack", "d2048"),
                                        ("gb200-11racks", "hero")])
def test_planner_state_is_the_sum_of_the_real_shards(pool, model):
    """Master weights under fsdp: exactly the bytes of the per-device shards of the real state."""
    from marin.training.lowering import abstract_mesh, abstract_state

    p = get_pool(pool)
    config = TrainConfig(output_path="", data=SyntheticDataConfig(), model=get_preset(model, n_layers=2), pool=pool,
                         telemetry=TelemetryConfig(wandb_project=None),
                         parallelism=ParallelismConfig(param_sharding="fsdp"))
    cfg = model_config(config)
    state, _ = abstract_state(config, cfg, make_mesh(*p.mesh) if p.is_cpu else abstract_mesh(*p.mesh))
    shard = sum(int(np.prod(s.sharding.shard_shape(s.shape))) * s.dtype.itemsize
                for s in jax.tree.leaves(state["params"]))
    assert 4 * params_per_device(cfg, p.mesh, "fsdp")["total"] == shard
    assert shard < 4 * params_per_device(cfg, p.mesh, "replicated")["total"]


def test_fsdp_plan_shrinks_the_state_and_pays_a_gathered_layer():
    cfg, pool = get_preset("d2048"), get_pool("gb200-11racks")
    rep = memory_plan(cfg, pool, 11_264 * 4096, 4096, 16, "fixed", "replicated")
    fsdp = memory_plan(cfg, pool, 11_264 * 4096, 4096, 16, "fixed", "fsdp")
    assert rep["gathered"] == 0 < fsdp["gathered"]
    # the dense weights' moments split 64 ways (11 racks divide none of d2048's dimensions)
    c = count_params(cfg)
    dense = c["total_params"] - c["routed_experts_total"]  # as stored (K/V padded)
    norms = cfg.n_layers * 2 * cfg.d_model + cfg.d_model  # replicated
    assert rep["optimizer_state"] - fsdp["optimizer_state"] == pytest.approx(8 * (dense - norms) * 63 / 64)
    assert fsdp["activations"] == rep["activations"]


def test_trainer_plans_microbatches_for_its_own_layout():
    """The trainer's automatic microbatch count follows the run's layout: d3072 on 11 racks at 4K
    needs fewer microbatches once its dense state is split."""
    from marin.training.trainer import microbatches_for

    pool = get_pool("gb200-11racks")
    counts = {}
    for mode in ("replicated", "fsdp"):
        config = TrainConfig(output_path="", data=SyntheticDataConfig(), model="d3072", pool=pool.name,
                             tokens_per_step=11_264 * 4096, seq_len_phases=((0.0, 4096),),
                             telemetry=TelemetryConfig(wandb_project=None),
                             parallelism=ParallelismConfig(param_sharding=mode))
        counts[mode] = microbatches_for(config, config.model, pool, 4096, "fixed")
    assert counts["fsdp"] < counts["replicated"]
