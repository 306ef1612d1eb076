"""MuonH's update against a slow numpy reference written from its definition, matrix by matrix: one
matrix, a stacked layer tensor, a stacked expert tensor (each expert its own norm), the hyperball
projection, the AdamH and Adam groups; and every norm under sharding on the 8-device CPU mesh
against the same update unsharded."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from marin.parallel.mesh import make_mesh, param_shardings
from marin.training.optimizers import MuonHConfig
from marin.training.optimizers.base import NEWTON_SCHULZ_COEFFS
from marin.training.optimizers.muonh import heuristic_hyperparameters
from marin.training.optimizers.updates import hyperball, nest, newton_schulz, orthogonalise

# float32 iterations against a float64 reference: Newton-Schulz's five quintic steps amplify the
# rounding of the normalised input by a few units in the fourth digit on these sizes
NS_TOL = dict(rtol=2e-4, atol=2e-5)


def ns_reference(x: np.ndarray, steps: int = 5, eps: float = 1e-8) -> np.ndarray:
    """Quintic Newton-Schulz of one matrix in float64, written out."""
    a, b, c = NEWTON_SCHULZ_COEFFS
    x = np.asarray(x, np.float64)
    x = x / (np.sqrt((x * x).sum()) + eps)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    for _ in range(steps):
        g = x @ x.T
        x = a * x + (b * g + c * g @ g) @ x
    return x.T if tall else x


def hyperball_reference(p: np.ndarray, u: np.ndarray, lr: float) -> np.ndarray:
    """The new value of one matrix: step along u scaled to |p|, then back onto the sphere of radius |p|."""
    p, u = np.asarray(p, np.float64), np.asarray(u, np.float64)
    norm = np.linalg.norm(p)
    q = p - lr * u * norm / np.linalg.norm(u)
    return q / np.linalg.norm(q) * norm


def matrices(x: np.ndarray):
    """Every matrix of a stacked array (its last two axes), with its index."""
    for idx in np.ndindex(*x.shape[:-2]):
        yield idx, x[idx]


def muonh_reference(cfg: MuonHConfig, params: dict, grads_per_step: list[dict], lrs: list[float]) -> dict:
    """Params after MuonH steps, leaf by leaf and matrix by matrix in float64 (flat dict of leaves)."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v2 = {k: np.zeros_like(v) for k, v in p.items()}
    for t, (grads, lr) in enumerate(zip(grads_per_step, lrs), start=1):
        for k in p:
            g = np.asarray(grads[k], np.float64)
            group = cfg.leaf_group(k, g.shape)
            if group == "muonh":
                m[k] = cfg.momentum * m[k] + g
                d = cfg.momentum * m[k] + g
                new = np.empty_like(p[k])
                for idx, mat in matrices(d):
                    new[idx] = hyperball_reference(p[k][idx], ns_reference(mat), lr)
                p[k] = new
                continue
            m[k] = cfg.beta1 * m[k] + (1 - cfg.beta1) * g
            v2[k] = cfg.beta2 * v2[k] + (1 - cfg.beta2) * g * g
            d = (m[k] / (1 - cfg.beta1 ** t)) / (np.sqrt(v2[k] / (1 - cfg.beta2 ** t)) + cfg.adam_eps)
            if group == "adamh":
                p[k] = hyperball_reference(p[k], d, lr)
            else:
                p[k] = p[k] - lr * cfg.adam_lr / cfg.peak_lr * d
    return p


def small_params(rng, *, layers=2, experts=4, d=8, q=12, lat=6, f=5, vocab=16):
    """A parameter tree with one leaf of each group's kinds (a dense stack, an expert stack, gains,
    the embedding, the router, the head)."""
    shapes = {"blocks/wq": (layers, d, q), "blocks/wo": (layers, q, d), "blocks/expert_up": (layers, experts, lat, f),
              "blocks/expert_down": (layers, experts, f, lat), "blocks/router": (layers, lat, experts),
              "blocks/attn_norm": (layers, d), "embed": (vocab, d), "lm_head": (d, vocab)}
    return {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}


def flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        key = f"{prefix}/{k}" if prefix else k
        out.update(flat(v, key) if isinstance(v, dict) else {key: v})
    return out


def run_steps(cfg: MuonHConfig, params: dict, grads_per_step: list[dict], lrs: list[float], shardings=None):
    tx = cfg.transformation()

    def step(p, s, g, lr):
        d, s = tx.update(g, s, p, lr=lr)
        return jax.tree.map(lambda a, b: a + b, p, d), s

    p = nest({k: jnp.asarray(v) for k, v in params.items()})
    if shardings is not None:
        p = jax.device_put(p, shardings)
    s = tx.init(p)
    jitted = jax.jit(step)
    for grads, lr in zip(grads_per_step, lrs):
        g = nest({k: jnp.asarray(v) for k, v in grads.items()})
        if shardings is not None:
            g = jax.device_put(g, shardings)
        p, s = jitted(p, s, g, jnp.float32(lr))
    return flat(jax.tree.map(np.asarray, p)), s


def test_newton_schulz_of_one_matrix_is_the_reference_and_nearly_orthogonal():
    rng = np.random.default_rng(0)
    for shape in ((8, 12), (12, 8), (16, 16)):
        x = rng.normal(size=shape).astype(np.float32)
        got = np.asarray(newton_schulz(jnp.asarray(x)))
        np.testing.assert_allclose(got, ns_reference(x), **NS_TOL)
        # the quintic iteration lands every singular value in about [0.68, 1.13], not exactly on 1
        s = np.linalg.svd(got, compute_uv=False)
        assert s.min() > 0.6 and s.max() < 1.2, s


def test_a_stack_is_orthogonalised_matrix_by_matrix():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 4, 6, 5)).astype(np.float32)
    x[1, 2] *= 1000.0  # one expert much larger: its scale must not leak into the others
    got = np.asarray(orthogonalise(jnp.asarray(x)))
    for idx, mat in matrices(x):
        np.testing.assert_allclose(got[idx], ns_reference(mat), **NS_TOL, err_msg=str(idx))


def test_the_hyperball_step_keeps_each_matrix_norm_and_matches_the_reference():
    rng = np.random.default_rng(2)
    p = rng.normal(size=(2, 3, 5, 4)).astype(np.float32)
    p[0, 1] *= 7.0  # matrices of one stack with different norms each keep their own
    u = rng.normal(size=p.shape).astype(np.float32)
    new = p + np.asarray(hyperball(jnp.asarray(p), jnp.asarray(u), jnp.float32(0.1)))
    for idx, mat in matrices(p):
        np.testing.assert_allclose(new[idx], hyperball_reference(mat, u[idx], 0.1), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.linalg.norm(new[idx]), np.linalg.norm(mat), rtol=1e-6)


def test_muonh_steps_match_the_reference_for_every_group():
    rng = np.random.default_rng(3)
    cfg = MuonHConfig(peak_lr=0.05, adam_lr=0.01)
    params = small_params(rng)
    grads = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()} for _ in range(3)]
    lrs = [0.05, 0.04, 0.03]
    got, state = run_steps(cfg, params, grads, lrs)
    want = muonh_reference(cfg, params, grads, lrs)
    for k in params:
        np.testing.assert_allclose(got[k], want[k], rtol=5e-4, atol=5e-5, err_msg=k)
    # the state holds one momentum buffer per MuonH matrix and Adam's moments for the rest
    assert set(flat(state.momentum)) == {"blocks/wq", "blocks/wo", "blocks/expert_up", "blocks/expert_down"}
    assert set(flat(state.mu)) == set(flat(state.nu)) == {"blocks/router", "blocks/attn_norm", "embed", "lm_head"}
    assert int(state.count) == 3
    # every MuonH matrix and the AdamH head kept its own norm (hyperball); the Adam leaves did not
    for k in ("blocks/wq", "blocks/expert_up", "lm_head"):
        np.testing.assert_allclose(np.linalg.norm(got[k], axis=(-2, -1)), np.linalg.norm(params[k], axis=(-2, -1)),
                                   rtol=1e-5)
    assert not np.allclose(np.linalg.norm(got["embed"]), np.linalg.norm(params["embed"]), rtol=1e-4)


def test_the_heuristic_is_upstreams_rule():
    tokens, d, batch = 2.0e10, 1024, 262_144
    h = heuristic_hyperparameters(tokens, d, batch)
    adam = 0.06602 * tokens ** -0.395 * d ** -0.15 * batch ** 0.5
    assert h["adam_lr"] == pytest.approx(adam, rel=1e-12)
    assert h["peak_lr"] == pytest.approx(min(13 / 3 * adam, 0.05), rel=1e-12)
    assert h["beta2"] == pytest.approx(0.999 ** 2, rel=1e-12)
    assert heuristic_hyperparameters(1e6, 64, 4 * 131_072)["peak_lr"] == 0.05  # capped
    assert heuristic_hyperparameters(1e12, 1024, 131_072 * 200)["beta2"] == 0.95  # clipped below
    assert heuristic_hyperparameters(1e12, 1024, 128)["beta2"] == 0.9999  # clipped above
    cfg = MuonHConfig.from_heuristic(tokens, d, batch, warmup_steps=3)
    assert (cfg.adam_lr, cfg.peak_lr, cfg.beta2, cfg.warmup_steps) == (h["adam_lr"], h["peak_lr"], h["beta2"], 3)


# fsdp splits both a dense matrix (over the mesh) and the expert stacks (experts over "expert", a matrix
# axis over "data"); replicated splits only the experts, a subset of it (slow: one more compilation)
@pytest.mark.parametrize("param_sharding", [pytest.param("replicated", marks=pytest.mark.slow), "fsdp"])
def test_sharded_muonh_matches_the_unsharded_update(param_sharding):
    """On the 8-device (2 x 4) mesh, with the model's own layout (experts over "expert", fsdp splits
    the dense matrices over the mesh), every norm (Newton-Schulz's normalisation, the hyperball's
    three) reduces over the shards exactly once: the same update as on one device."""
    rng = np.random.default_rng(4)
    cfg = MuonHConfig(peak_lr=0.05, adam_lr=0.01, grad_clip=1.0)
    params = small_params(rng, experts=8, d=16, q=16, lat=8, f=8, vocab=32)
    grads = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()} for _ in range(2)]
    lrs = [0.05, 0.05]
    mesh = make_mesh(2, 4)
    shardings = param_shardings(nest(params), mesh, param_sharding)
    assert shardings["blocks"]["expert_up"].spec[1] == "expert"
    if param_sharding == "fsdp":
        assert any(a is not None for a in shardings["blocks"]["wq"].spec)  # a dense matrix really split
    got, state = run_steps(cfg, params, grads, lrs, shardings)
    want, _ = run_steps(cfg, params, grads, lrs)
    for k in params:
        np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=2e-6, err_msg=k)
    momentum = state.momentum["blocks"]["expert_up"]
    assert momentum.sharding.spec[1] == "expert"  # the state stays where its parameter lives


def test_an_expert_stack_is_orthogonalised_without_gathering_it():
    """The compiled Newton-Schulz of an EP-sharded expert stack moves nothing between devices: no
    collective at all in the program (each device orthogonalises the experts it holds)."""
    layers, experts, lat, f = 2, 8, 16, 24
    mesh = make_mesh(2, 4)
    sharding = NamedSharding(mesh, P(None, "expert", None, None))
    x = jax.device_put(jnp.ones((layers, experts, lat, f), jnp.float32), sharding)
    hlo = jax.jit(orthogonalise, out_shardings=sharding).lower(x).compile().as_text()
    collectives = [line.strip() for line in hlo.splitlines()
                   if any(op in line for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute"))]
    assert "while" in hlo and not collectives, collectives  # the layer map runs; no data moves
