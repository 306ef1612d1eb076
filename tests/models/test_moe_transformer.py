"""The full model: losses, masks, router bias, remat, and EP transports vs the local path."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin.models import transformer as tf
from marin.models.config import get_preset
from marin.parallel.mesh import make_mesh

needs8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")


def setup(name="tiny", batch=8, seq=16, **overrides):
    """The model, its state and a batch. "tiny" and "tiny-ep" default to one layer: XLA drops the layer
    loop of a one-step scan, so its gradient compiles in about 2/3 of the 4-layer time, and the claims
    of the tests using it (losses, stats, gradients, remat, bias rules, masks, dtype, EP transports
    against the local path, drops) do not depend on depth; the local-window layers are tested on their
    own (test_local_layer_ignores_tokens_outside_window)."""
    if name in ("tiny", "tiny-ep"):
        overrides.setdefault("n_layers", 1)
    cfg = get_preset(name, **overrides)
    params = tf.init_params(cfg, jax.random.key(0))
    bias = tf.init_router_bias(cfg)
    tokens = jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, cfg.vocab_size, dtype=jnp.int32)
    return cfg, params, bias, tokens


@functools.lru_cache(maxsize=None)
def value_and_grad(cfg, mesh=None, transport=None):
    """Compiled once per (cfg, mesh, transport): ((loss, stats), (grad params, grad bias))."""
    f = lambda p, b, t: tf.loss_and_stats(p, b, t, cfg, mesh=mesh, transport=transport)  # noqa: E731
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))


@functools.lru_cache(maxsize=None)
def loss_fn(cfg, mesh=None, transport=None):
    return jax.jit(lambda p, b, t, seg=None: tf.loss_and_stats(p, b, t, cfg, mesh=mesh, transport=transport,
                                                               segment_ids=seg))


def test_loss_stats_and_z_loss():
    cfg, params, bias, tokens = setup(z_loss_weight=0.01)
    (loss, stats), _ = value_and_grad(cfg)(params, bias, tokens)
    logits, _ = jax.jit(lambda p, b, x: tf.forward(p, b, x, cfg))(params, bias, tokens[:, :-1])
    lse = jax.nn.logsumexp(logits, axis=-1)
    np.testing.assert_allclose(float(stats["z_loss"]), float(jnp.mean(lse**2)), rtol=1e-5)
    np.testing.assert_allclose(float(loss - stats["ce_loss"]), 0.01 * float(jnp.mean(lse**2)), rtol=1e-4)
    ce = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))
    np.testing.assert_allclose(float(stats["ce_loss"]), float(ce), rtol=1e-5)
    assert stats["expert_load"].shape == (cfg.n_layers, cfg.n_experts)
    assert float(stats["expert_load"].sum()) == cfg.n_layers * tokens[:, 1:].size * cfg.top_k
    assert stats["bias_target"].shape == (cfg.n_layers, cfg.n_experts)
    assert float(stats["drop_frac_send"]) == 0 and float(stats["drop_frac_recv"]) == 0


def test_sliding_window_and_document_masks_match_reference():
    seq, window = 12, 4
    seg = jnp.array([[0] * 5 + [1] * 7])
    mask = np.asarray(tf.attention_mask(seq, window, seg))[0]
    for i in range(seq):
        for j in range(seq):
            assert mask[i, j] == (j <= i and i - j < window and seg[0, i] == seg[0, j])
    full = np.asarray(tf.attention_mask(seq, tf.GLOBAL_WINDOW))[0]
    np.testing.assert_array_equal(full, np.tril(np.ones((seq, seq), bool)))


def test_local_layer_ignores_tokens_outside_window():
    cfg = get_preset("tiny")
    p = jax.tree.map(lambda a: a[0], tf.init_params(cfg, jax.random.key(0))["blocks"])
    x = jax.random.normal(jax.random.key(1), (1, 16, cfg.d_model))
    x2 = x.at[:, 2].add(5.0)  # perturb position 2
    w = 4
    # one program for the four calls: the window is traced, as in the layer scan (op by op, each call
    # would compile every operation of the layer again)
    attention = jax.jit(lambda x, window: tf.attention(x, p, window, None, cfg))
    a, b = attention(x, w), attention(x2, w)
    np.testing.assert_allclose(np.asarray(a[:, 2 + w:]), np.asarray(b[:, 2 + w:]), rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(a[:, 2 + w - 1]), np.asarray(b[:, 2 + w - 1]))
    g1, g2 = attention(x, tf.GLOBAL_WINDOW), attention(x2, tf.GLOBAL_WINDOW)
    assert not np.allclose(np.asarray(g1[:, -1]), np.asarray(g2[:, -1]))


def test_router_bias_zero_gradient_and_param_grads():
    cfg, params, bias, tokens = setup(z_loss_weight=0.01)
    _, (gp, gb) = value_and_grad(cfg)(params, bias + 0.1 * jnp.arange(cfg.n_experts), tokens)
    assert np.all(np.asarray(gb) == 0)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(gp))
    assert float(jnp.abs(gp["blocks"]["router"]).sum()) > 0  # the router learns through the combine weights
    assert float(jnp.abs(gp["blocks"]["expert_gate"]).sum()) > 0


def test_remat_policies_agree():
    cfg, params, bias, tokens = setup(z_loss_weight=0.01)
    _, (ref, _) = value_and_grad(cfg)(params, bias, tokens)
    _, (g, _) = value_and_grad(cfg.replace(remat_policy="dots"))(params, bias, tokens)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_update_router_bias_rules():
    cfg, params, bias, tokens = setup(z_loss_weight=0.01)
    (_, stats), _ = value_and_grad(cfg)(params, bias, tokens)
    new = tf.update_router_bias(bias, stats, cfg)
    np.testing.assert_allclose(np.asarray(new), np.asarray(stats["bias_target"]))
    sign_cfg = cfg.replace(router_bias_update="sign", router_bias_rate=0.01)
    _, stats = loss_fn(sign_cfg)(params, bias, tokens)
    new = np.asarray(tf.update_router_bias(bias, stats, sign_cfg))
    load = np.asarray(stats["expert_load"])
    assert np.all(np.sign(new) == np.sign(load.mean(1, keepdims=True) - load))


def test_document_masking_changes_attention():
    """One program: one document per row (the same function as no segment ids) vs two documents."""
    cfg, params, bias, tokens = setup()
    one = jnp.zeros((8, 17), jnp.int32)
    seg = jnp.concatenate([jnp.zeros((8, 9), jnp.int32), jnp.ones((8, 8), jnp.int32)], axis=1)
    f = loss_fn(cfg)
    l0, _ = f(params, bias, tokens, one)
    l1, _ = f(params, bias, tokens, seg)
    assert float(l0) != float(l1)


def test_bfloat16_runs():
    cfg, params, bias, tokens = setup(dtype="bfloat16")
    loss, _ = loss_fn(cfg)(params, bias, tokens)
    assert np.isfinite(float(loss))


@needs8
@pytest.mark.parametrize("data,ep,transport", [(1, 8, "fixed"), pytest.param(2, 4, "ragged", marks=pytest.mark.slow)])
def test_full_model_ep_transports_match_local_and_can_switch(data, ep, transport):
    """Same params and bias: local and EP paths (no drops) give one loss and one gradient; the
    transport is a per-call choice on the same training state (dropless is checked per block in
    tests/parallel)."""
    cfg, params, bias, tokens = setup("tiny-ep", capacity_factor=100.0)
    bias = bias + 0.05 * jax.random.normal(jax.random.key(5), bias.shape)
    (l0, s0), g0 = value_and_grad(cfg, None, "local")(params, bias, tokens)
    (l1, s1), g1 = value_and_grad(cfg, make_mesh(data, ep), transport)(params, bias, tokens)
    assert float(s1["drop_frac_send"]) == 0 and float(s1["drop_frac_recv"]) == 0
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(s1["expert_load"]), np.asarray(s0["expert_load"]))
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=1e-5)


@needs8
def test_fixed_transport_reports_drops_at_low_capacity():
    cfg, params, bias, tokens = setup("tiny-ep", capacity_factor=0.5)
    _, stats = loss_fn(cfg, make_mesh(2, 4))(params, bias, tokens)
    assert float(stats["drop_frac_send"]) + float(stats["drop_frac_recv"]) > 0.3
    assert stats["drop_frac_send_per_layer"].shape == (cfg.n_layers,)


def test_tiny_trains():
    import optax

    cfg, params, bias, tokens = setup(batch=4, seq=16)
    tokens = jnp.tile(jnp.arange(17, dtype=jnp.int32)[None] % 7, (4, 1))  # a learnable pattern
    opt = optax.adam(1e-2)
    state = opt.init(params)

    @jax.jit
    def step(params, state, bias):
        (loss, stats), g = jax.value_and_grad(lambda p: tf.loss_and_stats(p, bias, tokens, cfg), has_aux=True)(params)
        updates, state = opt.update(g, state)
        return optax.apply_updates(params, updates), state, tf.update_router_bias(bias, stats, cfg), loss

    losses = []
    for _ in range(25):
        params, state, bias, loss = step(params, state, bias)
        losses.append(float(loss))
    assert losses[-1] < 0.3 * losses[0]
