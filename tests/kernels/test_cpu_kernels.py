"""The CPU grouped-GEMM kernel (marin.kernels.cpu) against matmuls written the slow obvious way."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin import nativebuild
from marin.kernels import cpu

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRANSPOSES = [(False, False), (False, True), (True, False), (True, True)]


def operands(rng, g, m, k, n, trans_a, trans_b):
    a = rng.standard_normal((g, k, m) if trans_a else (g, m, k)).astype(np.float32)
    b = rng.standard_normal((g, n, k) if trans_b else (g, k, n)).astype(np.float32)
    return a, b


def reference(a, b, trans_a, trans_b, rows=None):
    """One group at a time in float64; only the first rows[g] rows of a's axis 1 count."""
    out = []
    for i in range(a.shape[0]):
        ai, bi = a[i].astype(np.float64), b[i].astype(np.float64)
        r = a.shape[1] if rows is None else min(max(int(rows[i]), 0), a.shape[1])
        if trans_a:  # a's rows are the contraction: padding adds nothing
            oi = ai[:r].T @ (bi.T if trans_b else bi)[:r]
        else:  # a's rows are the output rows: padding rows of the output are zero
            oi = np.zeros((ai.shape[0], (bi.T if trans_b else bi).shape[1]))
            oi[:r] = ai[:r] @ (bi.T if trans_b else bi)
        out.append(oi)
    return np.stack(out)


def test_kernel_is_built_and_used_here():
    """This machine has the compiler and the train extra: the MoE must really run the kernel."""
    assert cpu.available(), "the grouped GEMM kernel did not build (see the warning)"
    assert cpu.build().parent == nativebuild.cache_dir()
    f = jax.jit(lambda a, b: cpu.grouped_matmul(a, b))
    hlo = f.lower(jnp.ones((2, 3, 4)), jnp.ones((2, 4, 5))).compile().as_text()
    assert cpu.TARGET in hlo


@pytest.mark.parametrize("trans_a,trans_b", TRANSPOSES)
def test_matches_reference(trans_a, trans_b):
    rng = np.random.default_rng(0)
    a, b = operands(rng, 5, 37, 19, 23, trans_a, trans_b)
    got = jax.jit(lambda a, b: cpu.grouped_matmul(a, b, trans_a, trans_b))(a, b)
    np.testing.assert_allclose(np.asarray(got), reference(a, b, trans_a, trans_b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("trans_a,trans_b", TRANSPOSES)
def test_rows_skip_the_padding(trans_a, trans_b):
    """Only the filled rows are computed. The padding here is garbage, not zeros, to show it is
    never read (with op(a) = a^T, b's rows past rows[g] too); counts cover empty, partial, full and
    over-full (clamped) buffers."""
    rng = np.random.default_rng(1)
    a, b = operands(rng, 6, 16, 8, 12, trans_a, trans_b)
    rows = np.array([0, 1, 7, 16, 40, 3], np.int32)
    got = jax.jit(lambda a, b, r: cpu.grouped_matmul(a, b, trans_a, trans_b, rows=r))(a, b, rows)
    np.testing.assert_allclose(np.asarray(got), reference(a, b, trans_a, trans_b, rows), rtol=1e-4, atol=1e-4)


def test_zero_sized_operands():
    got = jax.jit(lambda a, b: cpu.grouped_matmul(a, b))(jnp.ones((3, 4, 0)), jnp.ones((3, 0, 5)))
    np.testing.assert_array_equal(np.asarray(got), np.zeros((3, 4, 5)))


def test_swiglu_experts_gradients_match_einsum():
    """swiglu_experts (the fixed transport's receivers) differentiates through the fused kernels."""
    from marin.kernels.grouped import swiglu_experts

    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 9, 6)).astype(np.float32)
    w = [rng.standard_normal(s).astype(np.float32) for s in ((4, 6, 5), (4, 6, 5), (4, 5, 6))]
    probe = rng.standard_normal((4, 9, 6)).astype(np.float32)

    def grads(f):
        return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * probe), argnums=(0, 1, 2, 3)))(x, *w)

    for g, want in zip(grads(swiglu_experts), grads(swiglu_slow)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-4, atol=1e-4)


def capacity_buffers(rng, e=5, c=12, d=16, f=24):
    """Per-expert buffers whose rows past rows[e] are zero, as the MoE's capacity path builds them."""
    rows = np.array([0, 3, 12, 7, 40][:e], np.int32)  # empty, partial, full, partial, over-full
    mask = (np.arange(c)[None, :] < np.minimum(rows, c)[:, None]).astype(np.float32)
    x = rng.standard_normal((e, c, d)).astype(np.float32) * mask[..., None]
    w = [rng.standard_normal(s).astype(np.float32) / np.sqrt(s[1]) for s in ((e, d, f), (e, d, f), (e, f, d))]
    return x, w, rows, mask


def swiglu_slow(x, w_gate, w_up, w_down):
    g = jnp.einsum("ecd,edf->ecf", x, w_gate)
    return jnp.einsum("ecf,efd->ecd", jax.nn.silu(g) * jnp.einsum("ecd,edf->ecf", x, w_up), w_down)


def test_swiglu_fwd_matches_einsum():
    x, w, rows, mask = capacity_buffers(np.random.default_rng(3))
    y, g, u = jax.jit(cpu.swiglu_fwd)(x, *w, rows)
    np.testing.assert_allclose(np.asarray(y), np.asarray(swiglu_slow(x, *w)), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(g), np.asarray(jnp.einsum("ecd,edf->ecf", x, w[0])), rtol=1e-4, atol=1e-5)
    assert not np.asarray(u)[mask == 0].any()  # padding rows of every output are zero


def test_swiglu_bwd_matches_autodiff_of_the_weighted_forward():
    """The fused backward against jax.grad of sum(dy * row_weight * SwiGLU(x)), written with einsums."""
    rng = np.random.default_rng(4)
    x, w, rows, mask = capacity_buffers(rng)
    dy = rng.standard_normal(x.shape).astype(np.float32) * mask[..., None]
    row_weight = rng.uniform(0.1, 1.0, mask.shape).astype(np.float32) * mask

    def loss(x, row_weight, *w):
        return jnp.sum(dy * row_weight[..., None] * swiglu_slow(x, *w))

    want = jax.grad(loss, argnums=(0, 1, 2, 3, 4))(x, row_weight, *w)
    _, g, u = cpu.swiglu_fwd(x, *w, rows)
    got = jax.jit(cpu.swiglu_bwd)(x, dy, row_weight, g, u, *w, rows)
    for name, a, b in zip(("dx", "d row_weight", "dw_gate", "dw_up", "dw_down"), got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5, err_msg=name)


PROBE = textwrap.dedent("""
    import warnings, numpy as np, jax, jax.numpy as jnp
    from marin.kernels import cpu
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = cpu.available()
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    b = np.ones((2, 4, 5), np.float32)
    out = np.asarray(jax.jit(cpu.grouped_matmul)(a, b))
    assert np.allclose(out, np.einsum("gmk,gkn->gmn", a, b))
    print("AVAILABLE", ok)
    for w in caught:
        print("WARNING", w.message)
""")


def run_probe(tmp_path, **env):
    full = {**os.environ, "MARIN_NATIVE_CACHE": str(tmp_path / "cache"), **env}
    return subprocess.Popen([sys.executable, "-c", PROBE], env=full, cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_without_a_compiler_it_warns_and_falls_back(tmp_path):
    proc = run_probe(tmp_path, CXX=str(tmp_path / "no-such-c++"))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "AVAILABLE False" in out
    assert "grouped GEMM kernel unavailable, using XLA's batched dot" in out and "no-such-c++" in out
    assert not list((tmp_path / "cache").glob("*.so"))  # no half-built library left behind


def test_switched_off_by_env(tmp_path):
    proc = run_probe(tmp_path, MARIN_DISABLE_NATIVE="1")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "AVAILABLE False" in out and "WARNING" not in out


@pytest.mark.slow  # 78 s on the loaded 2-core VM (two processes importing JAX); the shared builder's concurrent
# builds into one cache: tests/data/test_native.py::test_concurrent_builds_in_separate_processes
def test_two_processes_building_at_once_both_load_it(tmp_path):
    """Ray workers may build the kernel concurrently into one cache: each compiles to a private
    file and renames it, so neither ever loads half a library."""
    procs = [run_probe(tmp_path) for _ in range(2)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
        assert "AVAILABLE True" in out and "WARNING" not in out, out
    built = list((tmp_path / "cache").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so", built
