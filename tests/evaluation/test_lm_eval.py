"""Bits-per-byte evaluation: windows, packing, and the forward pass against a slow reference."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from marin.evaluation.evaluator import evaluate_prepared
from marin.evaluation.metrics import SetTotals, set_metrics, suite_metrics
from marin.evaluation.sets import Documents
from marin.evaluation.suite import prepare_suite
from marin.evaluation.windows import pack_windows, sequence_windows
from marin.models.config import get_preset
from marin.models.transformer import forward, init_params, init_router_bias

EOS = 5


def test_metrics_formulas():
    t = SetTotals(documents=2, tokens=10, bytes=40, nll=12.0)
    m = set_metrics(t)
    assert m["loss"] == pytest.approx(1.2)
    assert m["perplexity"] == pytest.approx(math.exp(1.2))
    assert m["bpb"] == pytest.approx(12.0 / math.log(2) / 40)
    s = suite_metrics({"a": t, "b": SetTotals(1, 5, 10, 1.0)})
    assert s["macro_bpb"] == pytest.approx((m["bpb"] + 1.0 / math.log(2) / 10) / 2)
    assert s["micro_bpb"] == pytest.approx(13.0 / math.log(2) / 50)
    with pytest.raises(ValueError, match="at least one token"):
        set_metrics(SetTotals(1, 0, 0, 0.0))


@pytest.mark.parametrize(
    "length,seq_len,stride", [(1, 4, 4), (2, 4, 4), (5, 4, 4), (6, 4, 4), (23, 8, 3), (30, 8, 8), (9, 8, 1)]
)
def test_windows_score_every_target_once_with_min_context(length, seq_len, stride):
    wins = sequence_windows(length, seq_len, stride)
    scored = [j for b, e, f in wins for j in range(f, e + 1)]
    assert scored == list(range(1, length))
    for k, (b, e, f) in enumerate(wins):
        assert e - b <= seq_len and b <= f - 1
        if k > 0:  # every target after the first window has at least seq_len - stride tokens of context
            assert f - b >= seq_len - stride


def test_pack_windows_rows_hold_each_scored_target_once():
    rng = np.random.default_rng(0)
    seqs = [np.concatenate([[EOS], rng.integers(6, 50, n)]).astype(np.int32) for n in (3, 17, 1, 8, 40, 0, 7)]
    rows = pack_windows(seqs, 16, 8)
    for i, s in enumerate(seqs):
        got = rows.targets[rows.sequence == i]
        assert sorted(got.tolist()) == sorted(s[1:].tolist())
    assert rows.inputs.shape[1] == 16
    # windows never share a segment id inside a row, and padding is segment 0
    assert ((rows.segment_ids == 0) <= (rows.sequence == -1)).all()


def _reference_nll(params, bias, cfg, s, seq_len, stride):
    """Token by token: target j is predicted from s[b:j], b = the start of the first window reaching j.

    One forward per target over exactly that context (right-padded to a fixed shape so it compiles
    once; causal attention makes the padding invisible to the last context position)."""
    fwd = jax.jit(lambda p, b, x: forward(p, b, x, cfg)[0])
    total = 0.0
    for j in range(1, len(s)):
        k = max(0, math.ceil((j - seq_len) / stride))
        b = k * stride
        ctx = np.zeros((1, seq_len), np.int32)
        ctx[0, : j - b] = s[b:j]
        lp = jax.nn.log_softmax(fwd(params, bias, ctx)[0, j - b - 1])
        total -= float(lp[int(s[j])])
    return total


@pytest.fixture(scope="module")
def tiny():
    cfg = get_preset("tiny", vocab_size=64, n_layers=2, sliding_window=6)
    return cfg, init_params(cfg, jax.random.PRNGKey(1)), init_router_bias(cfg) + 0.01


def test_evaluator_matches_token_by_token_reference(tiny):
    cfg, params, bias = tiny
    rng = np.random.default_rng(1)
    docs = [rng.integers(6, 64, n).astype(np.int32) for n in (4, 13, 1, 9)]
    sets = {"a": Documents(docs[:2], np.array([10, 30]), EOS), "b": Documents(docs[2:], np.array([2, 20]), EOS)}
    seq_len, stride = 8, 4
    suite = prepare_suite(sets, seq_len, batch_rows=2, stride=stride)
    got = evaluate_prepared(params, bias, suite, cfg, None)
    for name, idx in (("a", (0, 1)), ("b", (2, 3))):
        ref = sum(_reference_nll(params, bias, cfg, np.concatenate([[EOS], docs[i]]), seq_len, stride) for i in idx)
        assert got[name].nll == pytest.approx(ref, rel=1e-5)
        assert got[name].tokens == sum(docs[i].size for i in idx)
        assert got[name].documents == 2
    assert got["a"].bytes == 40


def test_expert_parallel_mesh_gives_the_same_scores(tiny):
    from marin.parallel.mesh import make_mesh

    cfg, params, bias = tiny
    cfg = cfg.replace(n_experts=8)
    params = init_params(cfg, jax.random.PRNGKey(2))
    bias = init_router_bias(cfg)
    rng = np.random.default_rng(2)
    docs = [rng.integers(6, 64, n).astype(np.int32) for n in rng.integers(1, 30, 8)]
    sets = {"x": Documents(docs, np.ones(len(docs), np.int64), EOS)}
    one = evaluate_prepared(params, bias, prepare_suite(sets, 16, 8), cfg, None)
    ep = evaluate_prepared(params, bias, prepare_suite(sets, 16, 8), cfg, make_mesh(2, 4))
    assert ep["x"].nll == pytest.approx(one["x"].nll, rel=1e-5)
