"""Parameter and FLOP accounting against the published figures and against the real params pytree."""

import json

import jax
import numpy as np
import pytest

from marin.cli import main as marin_main
from marin.models import config as C


@pytest.mark.parametrize("name,tol", [("hero", 0.005), ("d768", 0.10), ("d2048", 0.10)])
def test_presets_hit_published_counts(name, tol):
    total, active = C.PUBLISHED[name]
    c = C.count_params(C.get_preset(name))
    assert abs(c["total_params"] / total - 1) < tol
    assert abs(c["active_params"] / active - 1) < tol


def test_published_hero_counts_are_the_upstream_layouts_arrays():
    """The published 535.3B / 22.76B, rebuilt the slow obvious way from the upstream hero layout
    (marin-community/marin experiments/grug/moe_hero_ep/model.py: w_k/w_v stored at 12 KV heads on
    every layer, the router reading the full-width token): total = every weight matrix, embedding and
    head included; active = the same less the 376 unused routed experts and less embedding and head.
    Ours differs only in routing on the latent (3072 x 384 per layer instead of 6144 x 384)."""
    d, L, V, E, k, f, lat, kv_stored = 6144, 48, 128_256, 384, 8, 3072, 3072, 12
    per_layer = {
        "wq, wo": 2 * d * 48 * 128, "wk, wv (stored)": 2 * d * kv_stored * 128, "norms": 2 * d,
        "router (full width)": d * E, "latent down, up": 2 * d * lat, "shared": 2 * 3 * d * 3072,
    }
    total = L * (sum(per_layer.values()) + E * 3 * lat * f) + 2 * V * d + d
    active = L * (sum(per_layer.values()) + k * 3 * lat * f) + d
    assert round(total / 1e9, 1) == 535.3 and round(active / 1e9, 2) == 22.76
    c = C.count_params(C.get_preset("hero"))
    router_gap = L * (d - lat) * E  # 56.6M
    assert c["total_params"] + router_gap == total and c["active_params"] + router_gap == active


def test_flops_leave_out_the_kv_padding():
    # the hero's global layers multiply 12 stored KV heads and read 6: the FLOPs count 6, as if the
    # model were stored unpadded (the same rule as the padded expert units)
    h = C.get_preset("hero")
    uniform = h.replace(n_kv_heads_global=None)  # 12 KV heads read on every layer
    c = C.count_params(h)
    assert C.count_params(uniform)["active_params"] == c["active_params"]
    assert C.flops_per_token(uniform, 4096) - C.flops_per_token(h, 4096) == pytest.approx(6 * c["kv_padding"])


def test_hero_shape_matches_spec():
    h = C.get_preset("hero")
    assert (h.n_layers, h.d_model, h.n_heads, h.vocab_size) == (48, 6144, 48, 128_256)
    assert (h.latent_dim, h.n_experts, h.top_k, h.expert_width, h.n_shared_experts, h.shared_width) == (
        3072, 384, 8, 3072, 2, 3072)
    assert h.top_k * h.expert_width == 4 * h.d_model  # FLOP equivalence with a 4x dense MLP
    assert h.capacity_factor == 1.15


def test_hero_compute_about_2_7e24():
    h = C.get_preset("hero")
    fpt = C.flops_per_token(h, 4096)
    assert 2.6e24 < fpt * 18.75e12 < 2.8e24


@pytest.mark.parametrize("name", ["tiny", "tiny-ep"])
@pytest.mark.parametrize("tied", [False, True])
def test_count_params_equals_pytree(name, tied):
    from marin.models.transformer import init_params

    cfg = C.get_preset(name, tie_embeddings=tied)
    shapes = jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0))
    n = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes))
    assert C.count_params(cfg)["total_params"] == n


def test_active_params_by_hand():
    cfg = C.get_preset("tiny")
    c = C.count_params(cfg)
    assert c["total_params"] - c["active_params"] == (
        cfg.n_layers * (cfg.n_experts - cfg.top_k) * 3 * cfg.latent_dim * cfg.expert_width
        + c["embedding"] + c["lm_head"])


def test_mean_attended_keys_brute_force():
    for seq, w in [(16, None), (16, 4), (16, 16), (16, 100), (7, 1)]:
        ref = np.mean([min(i + 1, w or seq) for i in range(seq)])
        assert C.mean_attended_keys(seq, w) == pytest.approx(ref)


def test_flops_per_token_reference():
    cfg = C.get_preset("tiny")
    seq = 64
    c = C.count_params(cfg)
    matmul = c["attention"] + c["router"] + c["latent_proj"] + c["shared_experts"] + c["routed_experts_active"]
    matmul += cfg.vocab_size * cfg.d_model
    attn = 0.0
    for i in range(cfg.n_layers):
        window = seq if cfg.is_global_layer(i) else cfg.sliding_window
        keys = sum(min(p + 1, window) for p in range(seq)) / seq
        attn += 3 * 2 * 2 * cfg.n_heads * cfg.head_dim * keys
    assert C.flops_per_token(cfg, seq) == pytest.approx(6 * matmul + attn)


def test_layer_pattern():
    for n in (1, 4, 5, 8, 10, 48):
        cfg = C.get_preset("tiny", n_layers=n)
        for i in range(n):
            assert cfg.is_global_layer(i) == (i % 4 == 3 or i == n - 1)
    assert C.get_preset("hero").layer_windows().count(None) == 12


def test_get_preset_overrides_and_errors():
    assert C.get_preset("tiny", vocab_size=1000).vocab_size == 1000
    with pytest.raises(KeyError):
        C.get_preset("nope")
    with pytest.raises(ValueError):
        C.get_preset("tiny", transport="carrier-pigeon")


def test_model_info_json(capsys):
    assert marin_main(["model-info", "hero", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    for key in ("total_params", "active_params", "flops_per_token", "layers", "d_model", "num_experts", "top_k"):
        assert key in info
    assert info["layers"] == 48 and info["num_experts"] == 384 and info["top_k"] == 8
    assert marin_main(["model-info", "d768"]) == 0
    assert "active params" in capsys.readouterr().out
