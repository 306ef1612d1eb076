"""Grouped expert compute and the expert transports against the plain definitions in
marin.models.reference, on 8 fake CPU devices."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin.jaxcompat import lowering_for
from marin.kernels import grouped
from marin.models.reference import fixed_transport_survivors, moe_reference
from marin.parallel.mesh import batch_sharding, make_mesh
from marin.parallel.transports import moe_experts, recv_capacity, send_capacity

T, D, F, E, K = 64, 8, 16, 8, 2  # tokens, latent, expert width, experts, top-k

needs8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")


def make_experts(key, e=E, d=D, f=F):
    kg, ku, kd = jax.random.split(key, 3)
    return {
        "gate": jax.random.normal(kg, (e, d, f)) / math.sqrt(d),
        "up": jax.random.normal(ku, (e, d, f)) / math.sqrt(d),
        "down": jax.random.normal(kd, (e, f, d)) / math.sqrt(f),
    }


def make_routing(key, skew=0.0, t=T, e=E, k=K):
    """Distinct top-k expert ids per token; skew > 0 concentrates tokens on low expert ids."""
    kl, kw = jax.random.split(key)
    logits = jax.random.normal(kl, (t, e)) - skew * jnp.arange(e)[None, :]
    _, ids = jax.lax.top_k(logits, k)
    w = jax.nn.softmax(jax.random.normal(kw, (t, k)), axis=-1)
    return ids.astype(jnp.int32), w


def assert_close(got, want, rtol=1e-4, atol=1e-5):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol),
                 got, want)


def reference_value_and_grad(ids, probe, kept=None):
    """d/d(x, weights, experts) of sum(moe_reference(...) * probe), by plain autodiff."""
    return jax.value_and_grad(lambda x, w, ex: jnp.sum(moe_reference(x, ids, w, ex, kept) * probe),
                              argnums=(0, 1, 2))


# ---- grouped compute (one device) -----------------------------------------------------------
def test_rank_within_groups_matches_loop():
    rng = np.random.default_rng(0)
    g = rng.integers(0, 5, size=50)  # 4 = the "none" bucket
    key = rng.integers(0, 7, size=50)
    for use_key in (False, True):
        rank, counts = grouped.rank_within_groups(jnp.array(g), 4, jnp.array(key) if use_key else None)
        expect = np.zeros(50, int)
        for i in range(50):
            same = [j for j in range(50) if g[j] == g[i]]
            order = sorted(same, key=(lambda j: (key[j], j)) if use_key else (lambda j: j))
            expect[i] = order.index(i)
        np.testing.assert_array_equal(np.asarray(rank), expect)
        np.testing.assert_array_equal(np.asarray(counts), np.bincount(g, minlength=5)[:4])


@pytest.mark.parametrize("impl", grouped.GROUPED_IMPLS)
@pytest.mark.parametrize("skew", [0.0, 1.0, 6.0])  # 6.0: the busiest expert overflows every bucket
def test_routed_experts_values_and_grads_equal_reference(skew, impl):
    """One device's routed experts (capacity: the fused `capacity_moe`; ragged_dot, tokamax: the rows
    sorted by expert through `jax.lax.ragged_dot` / `tokamax.ragged_dot`, whose CPU path is tokamax's
    XLA implementation)."""
    x = jax.random.normal(jax.random.key(0), (T, D))
    ids, w = make_routing(jax.random.key(1), skew=skew)
    experts = make_experts(jax.random.key(2))
    probe = jax.random.normal(jax.random.key(3), (T, D))
    counts = np.bincount(np.asarray(ids).ravel(), minlength=E)
    if skew == 6.0:
        assert counts.max() > max(grouped.capacity_buckets(T * K / E))  # exercises the multi-round path

    def loss(x, w, experts):
        return jnp.sum(grouped.routed_experts(x, ids, w, experts, impl=impl) * probe)

    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, w, experts)
    assert_close(got, reference_value_and_grad(ids, probe)(x, w, experts))


@pytest.mark.parametrize("impl", grouped.GROUPED_IMPLS)
def test_grouped_swiglu_skips_rows_and_overflows_buckets(impl):
    """Rows with an expert id each (the EP receivers' case): 30 rows on one expert (more than the
    largest capacity bucket: several rounds) and 10 skipped rows (id E), values and gradients."""
    rows = jax.random.normal(jax.random.key(0), (40, D))
    experts = make_experts(jax.random.key(1))
    probe = jax.random.normal(jax.random.key(2), (40, D))
    row_expert = jnp.array([3] * 30 + [E] * 10, jnp.int32)
    assert 30 > max(grouped.capacity_buckets(40 / E))
    # as one-slot tokens: the skipped rows are assignments with weight 0
    ids, w = jnp.minimum(row_expert, E - 1)[:, None], (row_expert < E).astype(jnp.float32)[:, None]

    def loss(rows, experts):
        y = grouped.grouped_swiglu(rows, row_expert, experts["gate"], experts["up"], experts["down"], impl=impl)
        return jnp.sum(y * probe), y

    (value, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(rows, experts)
    assert np.all(np.asarray(y[30:]) == 0)
    want_value, (want_rows, _, want_experts) = reference_value_and_grad(ids, probe)(rows, w, experts)
    assert_close((value, grads), (want_value, (want_rows, want_experts)))


def test_swiglu_experts_equal_reference():
    """Per-expert buffers (the fixed transport's receivers): buffer e, row c through expert e."""
    xb = jax.random.normal(jax.random.key(0), (E, 5, D))
    experts = make_experts(jax.random.key(1))
    y = grouped.swiglu_experts(xb, experts["gate"], experts["up"], experts["down"])
    ids = jnp.repeat(jnp.arange(E), 5)[:, None]
    want = moe_reference(xb.reshape(E * 5, D), ids, jnp.ones((E * 5, 1)), experts)
    assert_close(y.reshape(E * 5, D), want)


def test_capacity_buckets_are_static_multiples_of_8():
    b = grouped.capacity_buckets(100.0)
    assert b == tuple(sorted(b)) and all(c % 8 == 0 for c in b) and b[0] >= 100 and b[-1] >= 200


def test_unknown_grouped_impl_is_a_clear_error():
    experts = make_experts(jax.random.key(1))
    with pytest.raises(ValueError, match="^unknown grouped_impl 'blocks'; choose from auto, capacity, ragged_dot, "
                                         "tokamax$"):
        grouped.grouped_swiglu(jnp.zeros((4, D)), jnp.zeros((4,), jnp.int32), experts["gate"], experts["up"],
                               experts["down"], impl="blocks")


# ---- transports -----------------------------------------------------------------------------
def _moe(x, ids, w, experts, mesh, transport, cf=1.15, grouped_impl=None):
    return moe_experts(x, ids, w, experts, n_experts=E, transport=transport, mesh=mesh, capacity_factor=cf,
                       grouped_impl=grouped_impl)


@needs8
@pytest.mark.parametrize("data,ep,transport", [(8, 1, "fixed"), (4, 2, "fixed"), (2, 4, "fixed"), (1, 8, "fixed"),
                                               (2, 4, "dropless"), (4, 2, "ragged")])
def test_ep_values_and_grads_equal_reference_when_nothing_drops(data, ep, transport):
    mesh = make_mesh(data, ep)
    x = jax.random.normal(jax.random.key(0), (T, D))
    ids, w = make_routing(jax.random.key(1), skew=0.5)
    experts = make_experts(jax.random.key(2))
    probe = jax.random.normal(jax.random.key(3), (T, D))

    def loss(x, w, experts):  # capacity factor 100 -> buffers capped at the worst case: nothing can drop
        y, s = _moe(x, ids, w, experts, mesh, transport, cf=100.0)
        return jnp.sum(y * probe), s

    (value, stats), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(x, w, experts)
    assert float(stats["send_drops"]) == 0 and float(stats["recv_drops"]) == 0
    assert float(stats["assignments"]) == T * K
    assert_close((value, grads), reference_value_and_grad(ids, probe)(x, w, experts))


@needs8
def test_local_on_a_mesh_is_per_device_local():
    """transport "local" with a 2 x 4 mesh: each device runs every expert on its own tokens
    (shard_map, expert weights gathered); values, grads and the summed stats equal one device's."""
    mesh = make_mesh(2, 4)
    x = jax.random.normal(jax.random.key(0), (T, D))
    ids, w = make_routing(jax.random.key(1), skew=1.0)
    experts = make_experts(jax.random.key(2))
    probe = jax.random.normal(jax.random.key(3), (T, D))

    def loss(x, w, experts, on_mesh):
        y, s = _moe(x, ids, w, experts, mesh if on_mesh else None, "local")
        return jnp.sum(y * probe), s

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3)
    (l0, s0), g0 = grad(x, w, experts, False)
    (l1, s1), g1 = grad(x, w, experts, True)
    assert float(s1["assignments"]) == float(s0["assignments"]) == T * K
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-5)
    assert_close(g1, g0)


@needs8
@pytest.mark.parametrize("transport", ["dropless", "ragged"])
@pytest.mark.parametrize("data,ep", [(2, 4), (1, 8)])
def test_dropless_equals_reference_under_skew(transport, data, ep):
    """Heavily skewed routing (most tokens to experts 0 and 1): the dropless paths drop nothing."""
    mesh = make_mesh(data, ep)
    x = jax.random.normal(jax.random.key(0), (T, D))
    ids, w = make_routing(jax.random.key(1), skew=4.0)
    experts = make_experts(jax.random.key(2))
    y, stats = jax.jit(lambda x, w, ex_: _moe(x, ids, w, ex_, mesh, transport))(x, w, experts)
    assert_close(y, moe_reference(x, ids, w, experts))
    assert float(stats["send_drops"]) == 0 and float(stats["recv_drops"]) == 0


@needs8
@pytest.mark.parametrize("impl", ["capacity", "ragged_dot"])
@pytest.mark.parametrize("transport,mesh_shape", [("local", None), ("dropless", (2, 4))])
def test_gpu_program_equals_reference(transport, mesh_shape, impl):
    """The program traced for a GPU (capacity buffers as plain einsums, or `ragged_dot`) runs on the
    CPU too and computes the same routed experts."""
    mesh = make_mesh(*mesh_shape) if mesh_shape else None
    x = jax.random.normal(jax.random.key(0), (T, D))
    ids, w = make_routing(jax.random.key(1), skew=2.0)
    experts = make_experts(jax.random.key(2))
    with lowering_for("cuda"):
        f = jax.jit(lambda x, w, ex_: _moe(x, ids, w, ex_, mesh, transport, grouped_impl=impl)[0])
        jaxpr = str(f.trace(x, w, experts).jaxpr)
        assert ("ragged_dot" in jaxpr) == (impl == "ragged_dot")  # on XLA:CPU it lowers to dense matmuls
        assert "marin_" not in jaxpr  # the GPU program: no CPU kernel
        y = f(x, w, experts)
    assert_close(y, moe_reference(x, ids, w, experts))


@needs8
@pytest.mark.parametrize("data,ep,skew", [(1, 8, 1.5), (2, 4, 1.0), (4, 2, 3.0)])
def test_fixed_drops_match_slow_reference(data, ep, skew):
    """cf 1.15, skewed routing: drop counts on both sides, and WHICH assignments survive, match."""
    mesh = make_mesh(data, ep)
    x = jax.random.normal(jax.random.key(0), (T, D))
    ids, w = make_routing(jax.random.key(4), skew=skew)
    experts = make_experts(jax.random.key(2))
    y, stats = jax.jit(lambda x, w, ex_: _moe(x, ids, w, ex_, mesh, "fixed", cf=1.15))(x, w, experts)
    kept, send_drops, recv_drops = fixed_transport_survivors(ids, data, ep, E, 1.15)
    assert send_drops > 0 and recv_drops > 0, "test routing should overflow on both sides"
    assert float(stats["send_drops"]) == send_drops
    assert float(stats["recv_drops"]) == recv_drops
    assert float(stats["assignments"]) == T * K
    assert_close(y, moe_reference(x, ids, w, experts, kept))


def test_capacities():
    # hero: 64 EP, 384 experts, top-8; per-rack 1024 x 4096 tokens -> 65,536 tokens per GPU
    t = 1024 * 4096 // 64
    assert send_capacity(t, 8, 384, 64, 1.15) == math.ceil(1.15 * t * 8 / 64)
    assert recv_capacity(t, 8, 384, 64, 1.15) == math.ceil(1.15 * 64 * t * 8 / 384)
    assert send_capacity(t, 8, 384, 64, None) == t * 6  # worst case: min(k, experts per device)
    assert recv_capacity(t, 8, 384, 64, None) == 64 * t


def test_unknown_transport_is_a_clear_error():
    experts = make_experts(jax.random.key(1))
    ids, w = make_routing(jax.random.key(1), t=8)
    with pytest.raises(ValueError, match="unknown EP transport 'gshard'; choose from"):
        _moe(jnp.zeros((8, D)), ids, w, experts, None, "gshard")


@needs8
def test_ragged_lowers_for_cuda():
    """The real ragged_all_to_all path (forward and backward) lowers for a GPU target from CPU."""
    mesh = make_mesh(2, 4)
    x = jax.random.normal(jax.random.key(0), (T, D))
    ids, w = make_routing(jax.random.key(1))
    experts = make_experts(jax.random.key(2))

    def f(x, w, experts):
        return jnp.sum(_moe(x, ids, w, experts, mesh, "ragged", grouped_impl="ragged_dot")[0])

    with lowering_for("cuda"):
        lowered = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2))).trace(x, w, experts).lower(
            lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "ragged_all_to_all" in text and "ragged_dot" in text.replace("ragged_dot_general", "ragged_dot")


@needs8
def test_batch_sharding_splits_over_all_devices():
    mesh = make_mesh(2, 4)
    tokens = jax.device_put(jnp.zeros((16, 9), jnp.int32), batch_sharding(mesh))
    assert {s.data.shape for s in tokens.addressable_shards} == {(2, 9)}
