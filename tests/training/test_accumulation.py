"""Gradient accumulation: 1 vs 4 microbatches give the same training up to float summation order, and
the router-bias and drop statistics aggregate over microbatches to the whole batch's values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin.models.config import get_preset
from marin.models.transformer import loss_and_stats
from marin.parallel.mesh import batch_sharding, make_mesh, place_host_arrays
from marin.training.accumulate import accumulate, split_microbatches
from marin.training.config import ParallelismConfig, SyntheticDataConfig, TelemetryConfig, TrainConfig
from marin.training.trainer import (
    init_host_state,
    make_train_step,
    model_config,
    state_shardings,
    synthetic_batch,
)


def _config(microbatches=1, **overrides):
    """tiny-ep with one layer and ``overrides`` (MoEConfig fields)."""
    return TrainConfig(output_path="", data=SyntheticDataConfig(),
                       model=get_preset("tiny-ep", **{"n_layers": 1, **overrides}), tokens_per_step=64 * 32,
                       seq_len_phases=((0.0, 32),), telemetry=TelemetryConfig(wandb_project=None),
                       parallelism=ParallelismConfig(microbatches=microbatches))


@pytest.fixture(scope="module")
def fresh_host_state():
    """The fresh state of the 1-layer tiny-ep model on the host, made once for the module (its jit takes
    seconds to compile). It is a function of the seed and the model's shapes: the microbatch count and
    the capacity factor, which the tests vary, do not enter it."""
    config = _config()
    return init_host_state(config, model_config(config))


def _run(host, transport, microbatches, pool_mesh=(2, 4), steps=3):
    config = _config(microbatches)
    cfg = model_config(config)
    mesh = make_mesh(*pool_mesh)
    shardings = state_shardings(host, mesh)
    # a copy: the step donates its state, and the module's fresh state is shared
    state = place_host_arrays(jax.tree.map(np.copy, host), shardings)
    step = make_train_step(config, cfg, mesh, transport, shardings, microbatches)
    out = []
    for i in range(steps):
        b = synthetic_batch(config.data, i, 64, 32)
        sharding = batch_sharding(mesh)
        state, m = step(state, *place_host_arrays((b["tokens"], b["segment_ids"]), sharding), jnp.float32(3e-3))
        out.append({k: float(v) for k, v in m.items()})
    return out, jax.device_get(state)


@pytest.mark.parametrize("transport", ["local", pytest.param("dropless", marks=pytest.mark.slow)])
def test_one_vs_four_microbatches_same_trajectory(transport, fresh_host_state):
    one, s1 = _run(fresh_host_state, transport, 1)
    four, s4 = _run(fresh_host_state, transport, 4)
    for a, b in zip(one, four):
        for key in ("loss", "ce_loss", "z_loss", "grad_norm", "expert_load_max", "router_bias_spread",
                    "drop_frac_send", "drop_frac_recv"):
            np.testing.assert_allclose(b[key], a[key], rtol=2e-5, atol=1e-6, err_msg=key)
    np.testing.assert_allclose(s4["router_bias"], s1["router_bias"], atol=1e-5)
    for x, y in zip(jax.tree.leaves(s1["params"]), jax.tree.leaves(s4["params"])):
        # AdamW normalises each element: a gradient near zero amplifies float reordering a little
        np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5)


def test_microbatch_stats_aggregate_to_the_whole_batch(fresh_host_state):
    """Expert load sums, margin histograms sum and give the whole batch's bias target, and drop
    fractions (fixed transport at a capacity that drops) are total drops over total assignments."""
    config = _config(capacity_factor=0.6)
    cfg = model_config(config)
    mesh = make_mesh(2, 4)
    # the 1-layer tiny-ep fresh state: the capacity factor changes no parameter
    host = fresh_host_state
    params, bias = host["params"], host["router_bias"] + np.linspace(-0.05, 0.05, 8, dtype=np.float32)
    b = synthetic_batch(config.data, 3, 32, 32)
    tokens, segs = b["tokens"], b["segment_ids"]

    def grad_fn(p, t, s, transport="fixed"):
        return jax.value_and_grad(lambda p: loss_and_stats(p, bias, t, cfg, mesh=mesh, transport=transport,
                                                           segment_ids=s), has_aux=True)(p)

    # the references need the loss and the statistics only: the forward pass alone (what value_and_grad
    # returns as its value and aux), which compiles in a fraction of the time of forward and backward
    def forward(p, t, s, transport="fixed"):
        return loss_and_stats(p, bias, t, cfg, mesh=mesh, transport=transport, segment_ids=s)

    def accumulated(transport):
        fn = lambda p, t, s: grad_fn(p, t, s, transport)  # noqa: E731
        return jax.jit(lambda p, t, s: accumulate(fn, p, bias, t, s, microbatches=4, mesh=mesh,
                                                  top_k=cfg.top_k))(params, tokens, segs)[0]

    loss4, st4 = accumulated("fixed")
    pieces = jax.jit(lambda t: split_microbatches(t, 4, mesh))
    mt, ms = np.asarray(pieces(tokens)), np.asarray(pieces(segs))
    assert sorted(map(tuple, mt.reshape(-1, 33))) == sorted(map(tuple, tokens))  # a partition of the batch
    fwd = jax.jit(forward)
    per = [fwd(params, mt[i], ms[i]) for i in range(4)]
    np.testing.assert_allclose(st4["expert_load"], sum(s["expert_load"] for _, s in per))
    np.testing.assert_allclose(loss4, np.mean([l for l, _ in per]), rtol=1e-6)
    drops = [float(s["drop_frac_send"]) for _, s in per]
    assert max(drops) > 0  # the capacity really drops
    np.testing.assert_allclose(st4["drop_frac_send"], np.mean(drops), rtol=1e-6)
    # Without drops (which depend on the per-wave token count) the whole batch in one piece sees the
    # same margins: the summed histogram is its histogram (up to a margin crossing a bin edge through
    # float reordering), hence the same bias target (bins are ~2e-3 wide).
    _, st4 = accumulated("dropless")
    _, whole = jax.jit(lambda p, t, s: forward(p, t, s, "dropless"))(params, tokens, segs)
    np.testing.assert_array_equal(st4["bias_hist"].sum(-1), whole["bias_hist"].sum(-1))
    assert np.abs(st4["bias_hist"] - whole["bias_hist"]).sum() <= 0.01 * whole["bias_hist"].sum()
    np.testing.assert_allclose(st4["bias_target"], whole["bias_target"], atol=2e-3)
    np.testing.assert_allclose(st4["expert_load"], whole["expert_load"])


def test_microbatches_must_split_the_batch():
    mesh = make_mesh(2, 4)
    with pytest.raises(ValueError, match="does not split into 3 microbatches over 8 devices"):
        split_microbatches(jnp.zeros((16, 5), jnp.int32), 3, mesh)


def test_microbatches_with_context_parallelism_keep_each_group_its_sequences():
    # C = 2 on a 2 x 4 mesh: 4 groups of 2 devices; 8 sequences = 2 per group, one per microbatch.
    # Microbatch m must give group g the m-th of group g's own sequences (no token moves between
    # devices), laid out as the whole batch is (split over "data" only), so that each microbatch is
    # again a context-parallel batch: every group the same number of whole sequences.
    mesh, degree, m = make_mesh(2, 4), 2, 2
    groups = mesh.size // degree
    tokens = np.arange(8)[:, None] * 100 + np.arange(5)[None, :]  # row i starts with 100 i
    x = place_host_arrays(tokens.astype(np.int32), batch_sharding(mesh, degree))
    y = jax.jit(lambda t: split_microbatches(t, m, mesh, degree))(x)
    assert tuple(y.sharding.spec)[:2] == (None, "data")  # [M, B / M, L]: rows over "data", as the batch
    per, per_mb = 8 // groups, 8 // groups // m
    for mb in range(m):
        for g in range(groups):
            got = np.asarray(y[mb, g * per_mb:(g + 1) * per_mb, 0]) // 100
            assert list(got) == [g * per + mb * per_mb + j for j in range(per_mb)]
    with pytest.raises(ValueError, match="does not split into 4 microbatches over 4 groups of 2 context-parallel"):
        split_microbatches(jnp.zeros((8, 5), jnp.int32), 4, mesh, degree)
