"""Routed experts stored at a padded width (MoEConfig.expert_width_multiple): the padded model is the
unpadded one exactly (same loss, same gradients, zero gradients into the padding), training keeps
the padding at exactly zero, and a width the data axis divides lets fsdp split the experts over it."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin.models.config import MoEConfig, count_params, get_preset, param_shapes
from marin.models.reference import moe_reference
from marin.models.transformer import init_params, loss_and_stats
from marin.parallel.mesh import batch_sharding, make_mesh, place_host_arrays
from marin.training.config import ParallelismConfig, SyntheticDataConfig, TelemetryConfig, TrainConfig
from marin.training.trainer import (
    init_host_state,
    make_train_step,
    model_config,
    state_shardings,
    synthetic_batch,
)

EXPERTS = ("expert_gate", "expert_up", "expert_down")


def _real(name, a, f):
    """The unpadded part of an expert leaf ([..., lat, f] for gate/up, [..., f, lat] for down)."""
    return a[..., :f, :] if name == "expert_down" else a[..., :f]


def _pad(name, a, f):
    """The padding of an expert leaf: the hidden units from ``f`` on."""
    return a[..., f:, :] if name == "expert_down" else a[..., f:]


def test_stored_width_and_validation():
    cfg = get_preset("tiny")
    assert cfg.stored_expert_width == 32
    assert cfg.replace(expert_width_multiple=12).stored_expert_width == 36
    assert cfg.replace(expert_width_multiple=8).stored_expert_width == 32  # already a multiple
    hero = get_preset("hero")
    assert (hero.expert_width, hero.stored_expert_width) == (3072, 3080) and 3080 % 11 == 0
    for bad in (0, -3, 2.5, True, "11"):
        with pytest.raises(ValueError, match=re.escape(f"model.expert_width_multiple must be >= 1 (a whole number), "
                                                       f"got {bad!r}")):
            MoEConfig(expert_width_multiple=bad)


def test_counts_are_the_models_and_storage_is_the_padded_pytree(capsys):
    from marin.cli import main as marin_main

    assert marin_main(["model-info", "hero"]) == 0
    assert "width 3072 (stored 3080)" in capsys.readouterr().out
    cfg = get_preset("hero")
    unpadded = cfg.replace(expert_width_multiple=1)
    c, c0 = count_params(cfg), count_params(unpadded)
    assert c == {**c0, "stored_params": c["stored_params"]}  # every model count is the unpadded one
    assert c0["stored_params"] == c0["total_params"]  # K/V counted as stored (12 heads everywhere)
    assert c["stored_params"] - c["total_params"] == 48 * 384 * 3 * 3072 * 8
    assert sum(int(np.prod(s)) for s in param_shapes(cfg).values()) == c["stored_params"]
    assert param_shapes(cfg)["blocks/expert_down"] == (48, 384, 3080, 3072)
    from marin.models.config import flops_per_token

    assert flops_per_token(cfg, 4096) == flops_per_token(unpadded, 4096)  # model FLOPs


def test_padded_model_computes_the_unpadded_model_exactly():
    # one layer: XLA drops the layer loop of a one-step scan, so each gradient compiles in about
    # 2/3 of the time; the padding is per layer and the same at any depth
    cfg = get_preset("tiny", n_layers=1)
    padded = cfg.replace(expert_width_multiple=12)  # 32 -> 36
    f = cfg.expert_width
    key = jax.random.PRNGKey(3)
    p0, p1 = init_params(cfg, key), init_params(padded, key)
    # the same draws, and the padding exactly zero
    for name, leaf in p1["blocks"].items():
        if name in EXPERTS:
            np.testing.assert_array_equal(_real(name, leaf, f), p0["blocks"][name])
            assert not np.any(np.asarray(_pad(name, leaf, f)))
        else:
            np.testing.assert_array_equal(leaf, p0["blocks"][name])
    # nonzero padding would change the output: prove the test can see it, then use the zero padding
    tokens = jax.random.randint(jax.random.PRNGKey(4), (4, 33), 0, cfg.vocab_size)

    @jax.jit
    def loss_grad(p):
        c = padded if p["blocks"]["expert_up"].shape[-1] != f else cfg
        bias = jnp.zeros((c.n_layers, c.n_experts))
        return jax.value_and_grad(lambda q: loss_and_stats(q, bias, tokens, c)[0])(p)

    l0, g0 = loss_grad(p0)
    l1, g1 = loss_grad(p1)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    for name, g in g1["blocks"].items():
        if name in EXPERTS:
            np.testing.assert_allclose(_real(name, g, f), g0["blocks"][name], rtol=1e-5, atol=1e-7)
            assert not np.any(np.asarray(_pad(name, g, f))), name  # exactly zero, not just small
        else:
            np.testing.assert_allclose(g, g0["blocks"][name], rtol=1e-5, atol=1e-7, err_msg=name)
    np.testing.assert_allclose(g1["embed"], g0["embed"], rtol=1e-5, atol=1e-7)
    noisy = jax.tree.map(lambda a: a, p1)
    noisy["blocks"]["expert_up"] = noisy["blocks"]["expert_up"].at[..., f:].set(1.0)
    noisy["blocks"]["expert_gate"] = noisy["blocks"]["expert_gate"].at[..., f:].set(1.0)
    noisy["blocks"]["expert_down"] = noisy["blocks"]["expert_down"].at[..., f:, :].set(1.0)
    assert abs(float(loss_grad(noisy)[0]) - float(l0)) > 1e-3

    # the reference expert computation (the transports' oracle) agrees too
    x = jax.random.normal(jax.random.PRNGKey(5), (6, cfg.latent_dim))
    ids = jnp.array([[0, 1], [2, 3], [1, 0], [3, 2], [0, 2], [1, 3]])
    w = jnp.full((6, 2), 0.5)
    ex = lambda p: {k: p["blocks"][f"expert_{k}"][0] for k in ("gate", "up", "down")}  # noqa: E731
    reference = jax.jit(moe_reference)  # one program per width; op by op it compiles every operation
    np.testing.assert_allclose(reference(x, ids, w, ex(p1)), reference(x, ids, w, ex(p0)), rtol=1e-6)


def _config(multiple):
    return TrainConfig(output_path="", data=SyntheticDataConfig(), tokens_per_step=48 * 32,
                       model=get_preset("tiny-ep", n_layers=2, expert_width_multiple=multiple),
                       seq_len_phases=((0.0, 32),), telemetry=TelemetryConfig(wandb_project=None),
                       parallelism=ParallelismConfig(param_sharding="fsdp"))


# 200 s on the loaded 2-core VM (two 3 x 2 meshes, three train steps each); its core, the padded model
# computing the unpadded one with exactly zero gradients into the padding, is
# test_padded_model_computes_the_unpadded_model_exactly; the fsdp layout rule is test_fsdp.py's
@pytest.mark.slow
@pytest.mark.parametrize("transport", ["fixed", "dropless"])
def test_training_keeps_the_padding_zero_and_fsdp_splits_it_over_data(transport):
    """Mesh 3 x 2: 3 divides neither the latent (32) nor the expert width (32), so unpadded experts
    split over "expert" only; padded to 33 they split over "data" too. Three AdamW steps (weight
    decay on) leave the padding and its moments exactly zero and train exactly like the unpadded model."""
    mesh = make_mesh(3, 2)
    runs = {}
    for multiple in (1, 3):
        config = _config(multiple)
        cfg = model_config(config)
        host = init_host_state(config, cfg)
        shardings = state_shardings(host, mesh, "fsdp")
        state = place_host_arrays(host, shardings)
        up = state["params"]["blocks"]["expert_up"]
        assert up.shape == (2, 8, 32, 32 if multiple == 1 else 33)
        assert tuple(up.sharding.spec) == ((None, "expert", None, None) if multiple == 1
                                           else (None, "expert", None, "data"))
        assert up.addressable_shards[0].data.shape == ((2, 4, 32, 32) if multiple == 1 else (2, 4, 32, 11))
        step = make_train_step(config, cfg, mesh, transport, shardings)
        metrics = []
        for i in range(3):
            b = synthetic_batch(config.data, i, 48, 32)
            s = batch_sharding(mesh)
            state, m = step(state, *place_host_arrays((b["tokens"], b["segment_ids"]), s), jnp.float32(3e-3))
            metrics.append({k: float(v) for k, v in m.items()})
        runs[multiple] = (metrics, jax.device_get(state))

    (m1, s1), (m3, s3) = runs[1], runs[3]
    assert config.optimizer.weight_decay > 0
    for tree in (s3["params"]["blocks"], s3["opt_state"][1].mu["blocks"], s3["opt_state"][1].nu["blocks"]):
        for name in EXPERTS:
            assert not np.any(_pad(name, tree[name], 32)), name
            assert np.any(_real(name, tree[name], 32)), name
    for a, b in zip(m1, m3):
        for key in ("loss", "grad_norm", "drop_frac_send"):
            np.testing.assert_allclose(b[key], a[key], rtol=2e-5, atol=1e-6, err_msg=key)
    assert m3[-1]["loss"] < m3[0]["loss"]
    for name in EXPERTS:
        np.testing.assert_allclose(_real(name, s3["params"]["blocks"][name], 32), s1["params"]["blocks"][name],
                                   rtol=1e-4, atol=1e-5)
