"""Cached decoding against the slow obvious reference: a full forward over the whole sequence for
every new token. Tiny models with local and global layers, generated past the sliding window."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from marin.models.config import get_preset
from marin.models.decode import (
    DecodeError,
    Sampling,
    cache_layout,
    decode_step,
    generate_tokens,
    init_cache,
    next_tokens,
)
from marin.models.transformer import forward, init_params, init_router_bias


@pytest.fixture(scope="module")
def model():
    # 5 layers: local, local, global, local, global (the last is always global); window 4
    cfg = get_preset("tiny", vocab_size=97, n_layers=5, global_every=3, sliding_window=4, max_seq_len=48)
    params = init_params(cfg, jax.random.PRNGKey(3))
    # a trained-looking router bias: it changes which experts tokens select, so decoding must use it
    bias = jax.random.normal(jax.random.PRNGKey(4), init_router_bias(cfg).shape) * 0.3
    return cfg, params, bias


def greedy_by_recompute(params, bias, cfg, prompt, n):
    """The reference: append argmax(forward(whole sequence)[last]) n times. The sequence is
    right-padded to one width so it compiles once (causal attention never sees the padding)."""
    fwd = _full_forward(cfg)
    seq = list(prompt)
    for _ in range(n):
        x = np.zeros((1, cfg.max_seq_len), np.int32)
        x[0, :len(seq)] = seq
        seq.append(int(np.argmax(np.asarray(fwd(params, bias, x))[0, len(seq) - 1])))
    return seq[len(prompt):]


_FORWARDS: dict = {}


def _full_forward(cfg):
    if cfg not in _FORWARDS:
        _FORWARDS[cfg] = jax.jit(lambda p, b, x: forward(p, b, x, cfg)[0])
    return _FORWARDS[cfg]


def test_layout_has_both_kinds(model):
    cfg, _, _ = model
    glob, loc = cache_layout(cfg)
    assert glob == [2, 4] and loc == [0, 1, 3]


def test_greedy_with_cache_equals_argmax_of_full_recompute_past_the_window(model):
    cfg, params, bias = model
    prompts = [[5, 9, 17], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [42]]  # different lengths, batched together
    got = generate_tokens(params, bias, cfg, prompts, 14, Sampling(greedy=True))
    for p, g in zip(prompts, got):
        assert len(p) + len(g) > 3 * cfg.sliding_window  # well past the window
        assert g == greedy_by_recompute(params, bias, cfg, p, 14)


def test_cached_logits_equal_full_forward_logits_at_every_position(model):
    """Prefill a chunk, then one token at a time: every position's logits match the full forward."""
    cfg, params, bias = model
    seq = np.random.default_rng(0).integers(0, cfg.vocab_size, 20).astype(np.int32)
    # the full forward the greedy reference compiles, right-padded (causal: the padding is unseen)
    padded = np.zeros((1, cfg.max_seq_len), np.int32)
    padded[0, :20] = seq
    full = np.asarray(_full_forward(cfg)(params, bias, padded))[0, :20]
    step = jax.jit(lambda p, b, c, x, pos: decode_step(p, b, c, x, pos, cfg))
    cache = init_cache(cfg, 1, 20)
    logits, cache = step(params, bias, cache, seq[None, :7], np.arange(7)[None])
    got = [np.asarray(logits)[0]]
    for t in range(7, 20):
        logits, cache = step(params, bias, cache, seq[None, t:t + 1], np.array([[t]]))
        got.append(np.asarray(logits)[0])
    np.testing.assert_allclose(np.concatenate(got), full, atol=2e-4, rtol=2e-4)


def test_prefill_longer_than_the_ring(model):
    """A prompt longer than the window fills the local ring with its last tokens only."""
    cfg, params, bias = model
    prompt = list(range(10, 30))
    assert generate_tokens(params, bias, cfg, [prompt], 6) == [greedy_by_recompute(params, bias, cfg, prompt, 6)]


def test_seeded_sampling_is_reproducible_and_seed_dependent(model):
    cfg, params, bias = model
    prompts = [[1, 2, 3], [7]]
    a = generate_tokens(params, bias, cfg, prompts, 12, Sampling(temperature=1.5, seed=7))
    b = generate_tokens(params, bias, cfg, prompts, 12, Sampling(temperature=1.5, seed=7))
    c = generate_tokens(params, bias, cfg, prompts, 12, Sampling(temperature=1.5, seed=8))
    assert a == b and a != c


def test_stop_ids_end_a_row(model):
    cfg, params, bias = model
    free = generate_tokens(params, bias, cfg, [[5, 9, 17]], 10)[0]
    stop = free[3]
    got = generate_tokens(params, bias, cfg, [[5, 9, 17]], 10, stop_ids=(stop,))[0]
    assert got == free[: free.index(stop) + 1]


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = jax.random.normal(jax.random.PRNGKey(0), (6, 50))
    greedy = np.asarray(next_tokens(logits, None, Sampling(greedy=True)))
    key = jax.random.PRNGKey(1)
    assert (np.asarray(next_tokens(logits, key, Sampling(top_k=1))) == greedy).all()
    assert (np.asarray(next_tokens(logits, key, Sampling(top_p=1e-6))) == greedy).all()
    # top_k=3: every draw is among the 3 most likely
    draws = np.stack([np.asarray(next_tokens(logits, jax.random.PRNGKey(s), Sampling(top_k=3))) for s in range(20)])
    top3 = np.argsort(-np.asarray(logits), axis=-1)[:, :3]
    assert all(d in top3[r] for row in draws for r, d in enumerate(row))


@pytest.mark.slow
def test_expert_parallel_mesh_decodes_the_same(model):
    from marin.parallel.mesh import make_mesh

    cfg, _, _ = model
    cfg = cfg.replace(n_experts=8)
    params, bias = init_params(cfg, jax.random.PRNGKey(5)), init_router_bias(cfg)
    prompts = [[5, 9, 17], [3, 1, 4, 1, 5], [8]]
    assert (generate_tokens(params, bias, cfg, prompts, 8, mesh=make_mesh(2, 4))
            == generate_tokens(params, bias, cfg, prompts, 8))


@pytest.mark.parametrize("prompts,kw,message", [
    ([], {}, "no prompts given"),
    ([[]], {}, "prompt 0 is empty"),
    ([[1, 2, 500]], {}, "outside the vocabulary"),
    ([[1] * 45], {}, "exceeds the model's context of 48"),
])
def test_bad_requests_are_one_line_errors(model, prompts, kw, message):
    cfg, params, bias = model
    with pytest.raises(DecodeError, match=message) as e:
        generate_tokens(params, bias, cfg, prompts, 4, **kw)
    assert "\n" not in str(e.value)


def test_temperature_must_be_positive_when_sampling():
    with pytest.raises(DecodeError, match="temperature must be > 0 when sampling.*--greedy"):
        Sampling(temperature=0.0)
    Sampling(greedy=True, temperature=0.0)  # greedy ignores the temperature
