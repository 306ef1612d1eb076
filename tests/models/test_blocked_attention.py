"""Blocked attention (online softmax over key blocks, custom VJP) is the dense attention: same outputs
and gradients in float32 for causal, sliding-window, packed-document and GQA cases, through the whole
model too; and its compiled memory grows like L, not L x L."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin.models.blocked_attention import blocked_attention, visible_key_blocks
from marin.models.config import MoEConfig, get_preset
from marin.models.transformer import GLOBAL_WINDOW, dense_attention, init_params, init_router_bias, loss_and_stats

B, KV, G, HD = 2, 2, 3, 8  # GQA: 6 query heads share 2 kv heads


def _qkv(length, seed=0):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(kq, (B, length, KV, G, HD), jnp.float32),
            jax.random.normal(kk, (B, length, KV, HD), jnp.float32),
            jax.random.normal(kv, (B, length, KV, HD), jnp.float32))


def _documents(length, seed=1):
    """Packed rows: document boundaries at random positions (crossing block boundaries), per row."""
    rng = np.random.default_rng(seed)
    starts = np.zeros((B, length), np.int32)
    for r in range(B):
        starts[r, rng.choice(np.arange(1, length), size=5, replace=False)] = 1
    return jnp.asarray(np.cumsum(starts, axis=1))


def _rel(a, b):
    """max |a - b| relative to max |b|, in numpy (jnp would compile its ops for each leaf's shape)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))


CASES = [  # (length, block, window, documents)
    (64, 16, GLOBAL_WINDOW, False),  # causal only
    (64, 16, 5, False),  # window smaller than a block
    (64, 16, 40, False),  # window over several blocks
    (64, 16, 16, True),  # window = block, packed documents
    (64, 16, GLOBAL_WINDOW, True),  # documents crossing block boundaries
    (60, 16, 23, True),  # a length the block does not divide: padded
    (24, 64, GLOBAL_WINDOW, False),  # shorter than one block
]


@functools.cache
def _value_and_grads(impl, block, documents):
    """One jitted program per (impl, block, documents), shared by the cases: the output and the
    gradients of sum(out * cot) for (q, k, v). The window and the document ids are arguments (traced),
    so the cases of one length and block compile it once."""
    def attend(q, k, v, w, seg):
        seg = seg if documents else None
        if impl == "dense":
            return dense_attention(q, k, v, w, seg)
        return blocked_attention(q, k, v, w, seg, block=block)

    def run(q, k, v, w, seg, cot):
        grads = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v, w, seg) * cot), argnums=(0, 1, 2))(q, k, v)
        return attend(q, k, v, w, seg), grads

    return jax.jit(run)


@pytest.mark.parametrize("length,block,window,documents", CASES)
def test_blocked_equals_dense_forward_and_gradients(length, block, window, documents):
    q, k, v = _qkv(length)
    seg = _documents(length) if documents else jnp.zeros((B, length), jnp.int32)  # unused without documents
    w = jnp.asarray(window, jnp.int32)
    cot = jax.random.normal(jax.random.PRNGKey(7), q.shape, jnp.float32)
    out_dense, g_dense = _value_and_grads("dense", None, documents)(q, k, v, w, seg, cot)
    out_blocked, g_blocked = _value_and_grads("blocked", block, documents)(q, k, v, w, seg, cot)
    assert _rel(out_blocked, out_dense) < 1e-5
    for a, b in zip(g_blocked, g_dense):
        assert _rel(a, b) < 1e-5


def test_visible_key_blocks_skip_future_and_out_of_window_blocks():
    assert [tuple(int(x) for x in visible_key_blocks(i, 16, GLOBAL_WINDOW)) for i in range(4)] == [
        (0, 0), (0, 1), (0, 2), (0, 3)]
    # window 5: the first query of block 3 (position 48) sees keys 44..48, so blocks 2..3
    assert tuple(int(x) for x in visible_key_blocks(3, 16, 5)) == (2, 3)
    assert tuple(int(x) for x in visible_key_blocks(3, 16, 1)) == (3, 3)  # only itself
    assert tuple(int(x) for x in visible_key_blocks(5, 16, 40)) == (2, 5)  # 80 - 40 + 1 = 41 -> block 2


@pytest.mark.slow  # 88 s on the loaded 2-core VM (two model compiles with gradients); its core, blocked attention
# equal to dense in value and gradient: test_blocked_equals_dense_forward_and_gradients
def test_model_loss_and_gradients_match_with_blocked_attention():
    """The whole model (layer scan with traced per-layer windows, documents, remat) is the same function."""
    dense_cfg = get_preset("tiny").replace(max_seq_len=64, sliding_window=12, remat_policy="dots")
    blocked_cfg = dense_cfg.replace(attention_impl="blocked", attention_block=16)
    params = init_params(dense_cfg, jax.random.PRNGKey(0))
    bias = init_router_bias(dense_cfg)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 65), 0, dense_cfg.vocab_size)
    seg = jnp.concatenate([_documents(64), jnp.full((2, 1), 99, jnp.int32)], axis=1)

    def grads(cfg):
        fn = lambda p: loss_and_stats(p, bias, tokens, cfg, segment_ids=seg)  # noqa: E731
        return jax.jit(jax.value_and_grad(fn, has_aux=True))(params)

    (loss_d, _), g_d = grads(dense_cfg)
    (loss_b, _), g_b = grads(blocked_cfg)
    assert abs(float(loss_b) - float(loss_d)) < 1e-5 * abs(float(loss_d))
    for a, b in zip(jax.tree.leaves(g_b), jax.tree.leaves(g_d)):
        assert _rel(a, b) < 1e-4


def _temp_bytes(fn, length, block=None):
    q, k, v = (jax.ShapeDtypeStruct((1, length) + s.shape[2:], s.dtype) for s in _qkv(8))
    w = jnp.int32(GLOBAL_WINDOW)

    def loss(q, k, v):
        o = fn(q, k, v, w) if block is None else fn(q, k, v, w, block=block)
        return jnp.sum(o * o)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_blocked_gradient_memory_grows_like_l_not_l_squared():
    """XLA's memory analysis of the compiled gradient: the dense one holds at least one full
    [L, L] f32 score matrix per head; the blocked one a small fraction of it, and doubling L about
    doubles it (dense: quadruples)."""
    heads, length, block = KV * G, 4096, 256
    one_score_matrix = heads * length * length * 4
    dense = _temp_bytes(dense_attention, length)
    blocked, blocked_half = _temp_bytes(blocked_attention, length, block), _temp_bytes(blocked_attention,
                                                                                        length // 2, block)
    assert dense >= one_score_matrix, dense
    assert blocked < one_score_matrix / 16, (blocked, dense)
    assert blocked < 2.5 * blocked_half, (blocked, blocked_half)


@pytest.mark.filterwarnings("ignore:training step 'hero'")  # importing the ladder declares the hero
def test_config_switch_and_its_errors():
    assert get_preset("tiny").attention_impl == "dense"
    for name in ("hero", "d768", "d2048", "d3072", "d4096"):
        assert get_preset(name).attention_impl == "blocked"
    from experiments.ladder import RUNGS  # the production ladder keeps the hero's recipe

    assert RUNGS and all(r.model.attention_impl == "blocked" for r in RUNGS)
    with pytest.raises(ValueError, match=r"^MoEConfig: attention_impl must be one of \('dense', 'blocked'\), "
                                         r"got 'flash'$"):
        MoEConfig(attention_impl="flash")
    with pytest.raises(ValueError, match=r"^model.attention_block must be >= 1 \(a whole number\), got 0$"):
        MoEConfig(attention_block=0)


def test_evaluator_forward_with_blocked_attention():
    """The evaluator's per-token NLL (packed windows with document ids, a row length the block does
    not divide) is the same with blocked attention."""
    from marin.evaluation.evaluator import nll_fn

    dense_cfg = get_preset("tiny").replace(sliding_window=7)
    params = init_params(dense_cfg, jax.random.PRNGKey(0))
    bias = init_router_bias(dense_cfg)
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 51), 0, dense_cfg.vocab_size)
    seg = _documents(50)
    args = (params, bias, tokens[:, :-1], tokens[:, 1:], seg)
    nll_dense = nll_fn(dense_cfg, None)(*args)
    nll_blocked = nll_fn(dense_cfg.replace(attention_impl="blocked", attention_block=16), None)(*args)
    assert nll_blocked.shape == (2, 50)
    assert _rel(nll_blocked, nll_dense) < 1e-5


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")
def test_blocked_attention_on_a_sharded_batch_matches_dense():
    """The batch split over a 2 x 4 (data, expert) mesh with the fixed EP transport, as in training."""
    from marin.parallel.mesh import batch_sharding, make_mesh

    # one layer (global: the windows are the unit cases' business): XLA drops the layer loop of a
    # one-step scan, so each gradient compiles in about 2/3 of the 4-layer time
    cfg = get_preset("tiny-ep", capacity_factor=100.0, sliding_window=12, max_seq_len=64, n_layers=1)
    params, bias = init_params(cfg, jax.random.PRNGKey(0)), init_router_bias(cfg)
    mesh = make_mesh(2, 4)
    tokens = jax.device_put(jax.random.randint(jax.random.PRNGKey(1), (8, 65), 0, cfg.vocab_size), batch_sharding(mesh))

    def value_and_grad(impl):
        c = cfg.replace(attention_impl=impl, attention_block=16)
        fn = lambda p: loss_and_stats(p, bias, tokens, c, mesh=mesh, transport="fixed")[0]  # noqa: E731
        return jax.jit(jax.value_and_grad(fn))(params)

    (loss_d, g_d), (loss_b, g_b) = value_and_grad("dense"), value_and_grad("blocked")
    assert abs(float(loss_b) - float(loss_d)) < 1e-5 * abs(float(loss_d))
    for a, b in zip(jax.tree.leaves(g_b), jax.tree.leaves(g_d)):
        assert _rel(a, b) < 1e-4


@pytest.mark.slow  # three model compiles (about 18 s here)
def test_bfloat16_blocked_gradients_are_no_further_from_float32_than_dense():
    """In bf16 the two differ by more than summation order (dense rounds the normalised
    probabilities to bf16; blocked rounds exp(s - running max) and normalises in float32): the
    blocked gradients are at least as close to the float32 model's as the dense ones."""
    cfg = get_preset("tiny").replace(max_seq_len=64, sliding_window=12, remat_policy="dots")
    params, bias = init_params(cfg, jax.random.PRNGKey(0)), init_router_bias(cfg)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (4, 65), 0, cfg.vocab_size)

    def grads(**kw):
        c = cfg.replace(**kw)
        fn = lambda p: loss_and_stats(p, bias, tokens, c)[0]  # noqa: E731
        return jnp.concatenate([g.ravel() for g in jax.tree.leaves(jax.jit(jax.grad(fn))(params))])

    ref = grads()
    err = {impl: float(jnp.linalg.norm(grads(dtype="bfloat16", attention_impl=impl, attention_block=16) - ref)
                       / jnp.linalg.norm(ref)) for impl in ("dense", "blocked")}
    assert err["blocked"] <= err["dense"], err
