"""Separate KV-head counts for local and global layers (the published hero: 12 local, 6 global):
counts, the stored layout, the training forward against the numpy reference, export, decoding."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin.models import config as C
from marin.models import numpy_forward
from marin.models.decode import decode_step, init_cache
from marin.models.exported import exported_shapes, exported_tensor, params_from_tensors
from marin.models.transformer import forward, init_params, init_router_bias, loss_and_stats


@pytest.fixture(scope="module")
def model():
    # 5 layers: local, local, global, local, global; 4 query heads: 2 KV heads local, 1 global
    cfg = C.get_preset("tiny", vocab_size=61, n_layers=5, global_every=3, sliding_window=4, n_kv_heads=2,
                       n_kv_heads_global=1, max_seq_len=32)
    params = init_params(cfg, jax.random.PRNGKey(0))
    bias = jax.random.normal(jax.random.PRNGKey(1), init_router_bias(cfg).shape) * 0.2
    return cfg, params, bias


def test_hero_has_the_published_attention_shape():
    h = C.get_preset("hero")
    assert (h.n_heads, h.n_kv_heads, h.kv_heads_global, h.head_dim, h.sliding_window) == (48, 12, 6, 128, 2048)
    assert [h.kv_heads_of(i) for i in range(8)] == [12, 12, 12, 6, 12, 12, 12, 6]
    total, active = C.PUBLISHED["hero"]
    c = C.count_params(h)
    # counted as published: K/V as stored (12 heads on every layer), so the counts equal those of 12
    # KV heads everywhere; the 12 global layers' 6 unread heads are the padding
    assert C.count_params(h.replace(n_kv_heads_global=None)) == {**c, "kv_padding": 0}
    assert c["kv_padding"] == 12 * 2 * 6144 * 768
    assert abs(c["total_params"] / total - 1) < 0.005
    assert abs(c["active_params"] / active - 1) < 0.005


def test_ladder_rungs_follow_the_hero_and_the_cpu_presets_keep_one_kv_count():
    for name, local, glob in (("d768", 1, 1), ("d2048", 4, 2), ("d3072", 6, 3), ("d4096", 8, 4)):
        cfg = C.get_preset(name)
        assert (cfg.n_kv_heads, cfg.kv_heads_global, cfg.sliding_window) == (local, glob, 2048)
    for name in ("tiny", "tiny-ep"):
        cfg = C.get_preset(name)
        assert cfg.n_kv_heads_global is None and cfg.stored_kv_heads == cfg.n_kv_heads
        assert C.count_params(cfg)["kv_padding"] == 0


@pytest.mark.parametrize("kw,message", [({"n_kv_heads_global": 3}, "n_kv_heads_global must be a divisor of n_heads"),
                                        ({"n_kv_heads_global": 0}, "model.n_kv_heads_global must be >= 1")])
def test_bad_kv_counts_are_one_line_errors(kw, message):
    with pytest.raises(ValueError, match=message) as e:
        C.get_preset("tiny", **kw)
    assert "\n" not in str(e.value)


@functools.cache
def _forward(cfg):
    """The jitted logits of the training forward, one per config (the tests share its compile)."""
    return jax.jit(lambda p, b, x: forward(p, b, x, cfg)[0])


def test_stored_pytree_count_and_zero_columns(model):
    cfg, params, _ = model
    c = C.count_params(cfg)
    n = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
    assert n == c["stored_params"] == c["total_params"]  # K/V counted as stored
    assert c["kv_padding"] == 2 * 2 * cfg.d_model * cfg.head_dim  # 2 global layers x (k, v) x 1 unused head
    hd = cfg.head_dim
    for i in range(cfg.n_layers):
        used = cfg.kv_heads_of(i) * hd
        for leaf in ("wk", "wv"):
            w = np.asarray(params["blocks"][leaf][i])
            assert np.all(w[:, used:] == 0) and np.any(w[:, :used] != 0)


def test_unused_columns_get_no_gradient(model):
    cfg, params, bias = model
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 13)), jnp.int32)
    grads = jax.jit(jax.grad(lambda p: loss_and_stats(p, bias, tokens, cfg)[0]))(params)
    hd = cfg.head_dim
    for i in range(cfg.n_layers):
        used = cfg.kv_heads_of(i) * hd
        for leaf in ("wk", "wv"):
            g = np.asarray(grads["blocks"][leaf][i])
            assert np.all(g[:, used:] == 0) and np.any(g[:, :used] != 0)


def test_forward_equals_the_numpy_reference_with_per_layer_heads(model):
    """The numpy reference reads each layer's heads from the exported shapes: 1 KV head on global
    layers, 2 on local ones (plain GQA, written the slow way)."""
    cfg, params, bias = model
    tensors = {name: exported_tensor(params, bias, cfg, name) for name in exported_shapes(cfg)}
    assert tensors["layers.2.wk"].shape == (cfg.d_model, cfg.head_dim)
    assert tensors["layers.1.wk"].shape == (cfg.d_model, 2 * cfg.head_dim)
    # [2, 20]: the shape test_decode_caches_each_kind_at_its_own_heads_and_matches_forward runs the
    # dense forward at, so the two share its compile
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 20)).astype(np.int32)
    want = numpy_forward.forward(tensors, dataclasses.asdict(cfg), tokens)
    for impl in ("dense", "blocked"):
        got = np.asarray(_forward(cfg.replace(attention_impl=impl, attention_block=4))(params, bias, tokens))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)  # float32, summation order only
    params2, bias2 = params_from_tensors(lambda n: tensors[n], cfg)
    for a, b in zip(jax.tree.leaves(params2), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, np.asarray(b))  # the stored zero columns come back


def test_decode_caches_each_kind_at_its_own_heads_and_matches_forward(model):
    cfg, params, bias = model
    cache = init_cache(cfg, 1, 20)
    assert cache["global_k"].shape[-2] == 1 and cache["local_k"].shape[-2] == 2
    seq = np.random.default_rng(2).integers(0, cfg.vocab_size, 20).astype(np.int32)
    other = np.random.default_rng(3).integers(0, cfg.vocab_size, 20).astype(np.int32)
    full = np.asarray(_forward(cfg.replace(attention_impl="dense", attention_block=4))(
        params, bias, np.stack([seq, other])))[0]  # rows are independent; row 0 is seq
    step = jax.jit(lambda p, b, c, x, pos: decode_step(p, b, c, x, pos, cfg))
    logits, cache = step(params, bias, cache, seq[None, :7], np.arange(7)[None])
    got = [np.asarray(logits)[0]]
    for t in range(7, 20):
        logits, cache = step(params, bias, cache, seq[None, t:t + 1], np.array([[t]]))
        got.append(np.asarray(logits)[0])
    np.testing.assert_allclose(np.concatenate(got), full, atol=2e-4, rtol=2e-4)
