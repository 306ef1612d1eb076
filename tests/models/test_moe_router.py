"""Router selection and the two bias-balancing rules."""

import jax
import jax.numpy as jnp
import numpy as np

from marin.models import router as rt


def skewed_scores(t=4096, e=16, skew=0.25, seed=0):
    logits = jax.random.normal(jax.random.key(seed), (t, e)) + skew * jnp.arange(e)[None, :]
    return jax.nn.sigmoid(logits)


def load_of(scores, bias, k):
    _, ids = jax.lax.top_k(scores + bias[None, :], k)
    return np.bincount(np.asarray(ids).reshape(-1), minlength=scores.shape[1])


def test_bias_steers_selection_not_combine_weights():
    z = jax.random.normal(jax.random.key(0), (32, 8))
    w = jax.random.normal(jax.random.key(1), (8, 6))
    bias = jnp.array([10.0, 0, 0, 0, 0, -10.0])
    ids, weights, scores = rt.route(z, w, bias, 2)
    ids, weights, scores = map(np.asarray, (ids, weights, scores))
    assert np.all((ids == 0).any(axis=1))  # bias forces expert 0 in
    assert not np.any(ids == 5)  # and keeps expert 5 out
    sel = np.take_along_axis(scores, ids, axis=1)
    np.testing.assert_allclose(weights, sel / sel.sum(1, keepdims=True), rtol=1e-6)


def test_router_bias_gets_no_gradient():
    z = jax.random.normal(jax.random.key(0), (32, 8))
    w = jax.random.normal(jax.random.key(1), (8, 6))

    def f(bias, w):
        _, weights, scores = rt.route(z, w, bias, 2)
        return jnp.sum(weights * jnp.arange(2)) + jnp.sum(scores)

    gb, gw = jax.grad(f, argnums=(0, 1))(jnp.zeros(6), w)
    assert np.all(np.asarray(gb) == 0)
    assert np.any(np.asarray(gw) != 0)


def test_selection_margins_predict_selection():
    scores = skewed_scores(t=256, e=8)
    bias = jax.random.normal(jax.random.key(3), (8,)) * 0.1
    u = np.asarray(rt.selection_margins(scores, bias, 3))
    _, ids = jax.lax.top_k(scores + bias[None], 3)
    chosen = np.zeros(u.shape, bool)
    np.put_along_axis(chosen, np.asarray(ids), True, axis=1)
    np.testing.assert_array_equal(u + np.asarray(bias)[None] > 0, chosen)


def test_histogram_target_close_to_exact_quantile():
    scores = skewed_scores()
    bias = jnp.zeros(16)
    hist = np.asarray(rt.quantile_bias_target(scores, bias, 2, n_bins=1024))
    exact = np.asarray(rt.quantile_bias_target_exact(scores, bias, 2))
    assert abs(hist.mean()) < 1e-5
    np.testing.assert_allclose(hist, exact, atol=2 * (2.0 / 1024))


def test_quantile_balancing_converges_in_a_few_updates():
    scores, k = skewed_scores(), 2
    bias = jnp.zeros(16)
    load = load_of(scores, bias, k)
    assert load.max() / load.mean() > 2.5  # really skewed to start with
    for _ in range(4):
        bias = rt.quantile_update(bias, rt.quantile_bias_target(scores, bias, k), 1.0)
    load = load_of(scores, bias, k)
    assert load.max() / load.mean() < 1.1
    assert abs(float(jnp.mean(bias))) < 1e-5


def test_sign_step_moves_the_right_way():
    scores, k = skewed_scores(), 2
    bias = jnp.zeros(16)
    load0 = load_of(scores, bias, k)
    new = np.asarray(rt.sign_update(bias, jnp.asarray(load0, jnp.float32), 0.01))
    over, under = load0 > load0.mean(), load0 < load0.mean()
    assert np.all(new[over] < 0) and np.all(new[under] > 0)
    np.testing.assert_allclose(np.abs(new), 0.01)
    for _ in range(100):
        bias = rt.sign_update(bias, jnp.asarray(load_of(scores, bias, k), jnp.float32), 0.01)
    load = load_of(scores, bias, k)
    assert load.max() / load.mean() < 0.5 * load0.max() / load0.mean()
