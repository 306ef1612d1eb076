"""The capacity-bounded ragged transport (`ragged_capacity`) against the plain definitions in
marin.models.reference and marin.parallel.capacity, on 8 fake CPU devices (the emulated ragged
collective stands in for `jax.lax.ragged_all_to_all`, which XLA:CPU lacks)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_ep_transports import assert_close, make_experts, make_routing, reference_value_and_grad

from marin.jaxcompat import lowering_for
from marin.models.reference import fixed_transport_survivors, moe_reference, ragged_capacity_survivors
from marin.parallel.capacity import (
    buffer_rows_per_token,
    chunk_capacity,
    emulated_ragged_rows_per_token,
    recv_capacity,
)
from marin.parallel.mesh import EXPERT, make_mesh
from marin.parallel.transports import moe_experts, ragged_all_to_all_emulated

T, D, E, K = 64, 8, 16, 2

needs8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")


def _moe(x, ids, w, experts, mesh, transport="ragged_capacity", cf=1.15, chunks=2, grouped_impl=None):
    return moe_experts(x, ids, w, experts, n_experts=E, transport=transport, mesh=mesh, capacity_factor=cf,
                       expert_chunks=chunks, grouped_impl=grouped_impl)


# ---- the formulas ------------------------------------------------------------------------------
def test_chunk_capacity_is_cf_times_the_chunks_expected_rows():
    t = 1024 * 4096 // 64 // 8  # the hero at 4K: 65,536 tokens per GPU and step, 8 microbatches
    # 384 experts over 64 devices: 6 local experts, 2 chunks of 3
    expected = 64 * t * 8 * 3 / 384
    assert chunk_capacity(t, 8, 384, 64, 1.15, 2) == math.ceil(1.15 * expected)
    # pooled: a chunk's buffer is the sum of its experts' fixed buffers (up to rounding)
    assert abs(chunk_capacity(t, 8, 384, 64, 1.15, 2) - 3 * recv_capacity(t, 8, 384, 64, 1.15)) <= 3
    assert chunk_capacity(t, 8, 384, 64, None, 2) == 64 * t * 3  # worst case: min(k, 3) per token and source
    assert chunk_capacity(4, 8, 384, 64, 100.0, 6) == 64 * 4 * 1  # capped at the worst case
    with pytest.raises(ValueError, match="expert_chunks=4 must be a positive int dividing the 6 local experts"):
        chunk_capacity(t, 8, 384, 64, 1.15, 4)


def test_buffer_rows_are_the_real_assignments_out_and_one_chunk_in():
    t = 8192
    rows = buffer_rows_per_token("ragged_capacity", t, 8, 384, 64, 1.15, 2)
    cap = chunk_capacity(t, 8, 384, 64, 1.15, 2)
    assert rows == {"send": 8.0, "compute": 2 * cap / t, "buffers": 16.0 + cap / t}
    fixed = buffer_rows_per_token("fixed", t, 8, 384, 64, 1.15)
    assert rows["compute"] == pytest.approx(fixed["compute"], rel=1e-3)  # the same rows reach the experts
    assert rows["buffers"] < fixed["buffers"]  # no padded send slots


def test_the_cpu_emulation_blocks_are_ep_worst_case_copies_of_the_operand():
    t = 512
    # ragged_capacity: the dispatch operand (t * k rows) is the larger; sent as ep blocks and received
    assert emulated_ragged_rows_per_token("ragged_capacity", t, 2, 16, 4, 1.15, 2) == 2 * 4 * 2
    # ragged: its return operand is the worst-case receive buffer, ep * t * min(k, e_loc) rows
    assert emulated_ragged_rows_per_token("ragged", t, 2, 16, 4, 1.15) == 2 * 4 * 4 * 2
    assert emulated_ragged_rows_per_token("fixed", t, 2, 16, 4, 1.15) == 0.0


def test_survivors_rule_by_hand():
    """2 devices x 2 local experts (one chunk each of 2 experts... here chunks=1: one buffer per
    device), 2 tokens per device, top-1; cf 1.0: a chunk holds ceil(2 * 2 * 1 * 2 / 4) = 2 rows."""
    ids = np.array([[0], [1], [0], [0]])  # device 0's tokens 0,1; device 1's tokens 2,3; all to device 0
    kept, send, recv = ragged_capacity_survivors(ids, 1, 2, 4, 1.0, 1)
    # device 0's buffer, expert by expert, source by source: expert 0 <- src0 t0, src1 t2, t3 | expert 1 <- t1
    assert kept[:, 0].tolist() == [True, False, True, False]
    assert (send, recv) == (0, 2)


# ---- the emulated collective ---------------------------------------------------------------------
@needs8
def test_emulated_ragged_all_to_all_with_several_updates_per_peer():
    """Each of 4 devices sends 2 updates to every device (K = 8); the emulation equals the
    semantics of jax.lax.ragged_all_to_all written as a loop."""
    ep, n, m, per = 4, 24, 40, 2
    rng = np.random.default_rng(0)
    sizes = rng.integers(0, 3, size=(ep, ep, per))  # [src, dst, update]
    operand = rng.normal(size=(ep, n, 3)).astype(np.float32)
    in_off = np.zeros((ep, ep * per), np.int32)
    out_off = np.zeros((ep, ep * per), np.int32)
    for s in range(ep):
        in_off[s] = np.concatenate([[0], np.cumsum(sizes[s].reshape(-1))[:-1]]) + 1  # a row of padding first
    nxt = np.zeros(ep, int)
    for s in range(ep):
        for dd in range(ep):
            for u in range(per):
                out_off[s, dd * per + u] = nxt[dd]
                nxt[dd] += sizes[s, dd, u] + 1  # a gap between updates
    recv = np.stack([sizes[:, r, :].reshape(-1) for r in range(ep)]).astype(np.int32)
    want = np.full((ep, m, 3), -1.0, np.float32)
    for s in range(ep):
        for i in range(ep * per):
            dd, sz = i // per, sizes[s].reshape(-1)[i]
            want[dd, out_off[s, i]:out_off[s, i] + sz] = operand[s, in_off[s, i]:in_off[s, i] + sz]
    mesh = make_mesh(1, ep)
    spec = jax.sharding.PartitionSpec(EXPERT)
    f = jax.shard_map(lambda o, a, b, c, d: ragged_all_to_all_emulated(
        o[0], jnp.full((m, 3), -1.0), a[0], b[0], c[0], d[0], axis_name=EXPERT)[None],
        mesh=mesh, in_specs=(spec,) * 5, out_specs=spec)
    got = jax.jit(f)(operand, in_off, sizes.reshape(ep, -1).astype(np.int32), out_off, recv)
    np.testing.assert_array_equal(np.asarray(got), want)


# ---- the transport ---------------------------------------------------------------------------
slow = pytest.mark.slow  # each compiles the backward of the emulated collective per chunk: tens of seconds here


@needs8
@pytest.mark.parametrize("data,ep,chunks", [(2, 4, 1), pytest.param(2, 4, 2, marks=slow),
                                            pytest.param(1, 8, 2, marks=slow), pytest.param(4, 2, 4, marks=slow)])
def test_values_and_grads_equal_reference_when_nothing_drops(data, ep, chunks):
    mesh = make_mesh(data, ep)
    x = jax.random.normal(jax.random.key(0), (T, D))
    ids, w = make_routing(jax.random.key(1), skew=0.5, e=E)
    experts = make_experts(jax.random.key(2), e=E)
    probe = jax.random.normal(jax.random.key(3), (T, D))

    def loss(x, w, experts):  # capacity factor 100 -> buffers capped at the worst case: nothing can drop
        y, s = _moe(x, ids, w, experts, mesh, cf=100.0, chunks=chunks)
        return jnp.sum(y * probe), s

    (value, stats), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(x, w, experts)
    assert float(stats["send_drops"]) == 0 and float(stats["recv_drops"]) == 0
    assert float(stats["assignments"]) == T * K
    assert_close((value, grads), reference_value_and_grad(ids, probe)(x, w, experts))


OVERFLOWING = [(1, 8, 2, 1.5, 1.15), (2, 4, 1, 3.0, 1.0), (2, 4, 2, 1.0, 1.15), (4, 2, 4, 2.0, 1.25)]


@needs8
@pytest.mark.parametrize("data,ep,chunks,skew,cf", OVERFLOWING[:2] + [pytest.param(*c, marks=slow)
                                                                     for c in OVERFLOWING[2:]])
def test_overflowing_chunks_drop_exactly_what_the_reference_drops(data, ep, chunks, skew, cf):
    """Skewed routing overflows chunk buffers: the drop count and WHICH assignments survive (through
    the output) match the slow reference."""
    mesh = make_mesh(data, ep)
    x = jax.random.normal(jax.random.key(0), (T, D))
    ids, w = make_routing(jax.random.key(4), skew=skew, e=E)
    experts = make_experts(jax.random.key(2), e=E)
    kept, send_drops, recv_drops = ragged_capacity_survivors(ids, data, ep, E, cf, chunks)
    assert recv_drops > 0, "test routing should overflow a chunk"
    y, stats = jax.jit(lambda x, w, ex_: _moe(x, ids, w, ex_, mesh, cf=cf, chunks=chunks))(x, w, experts)
    assert float(stats["send_drops"]) == send_drops == 0
    assert float(stats["recv_drops"]) == recv_drops
    assert float(stats["assignments"]) == T * K
    assert_close(y, moe_reference(x, ids, w, experts, kept))


@needs8
@pytest.mark.parametrize("data,ep,chunks,skew,cf", [pytest.param(*c, marks=slow) for c in OVERFLOWING])
def test_overflowing_chunks_gradients_equal_reference(data, ep, chunks, skew, cf):
    """The same with gradients: what was dropped gets none."""
    mesh = make_mesh(data, ep)
    x = jax.random.normal(jax.random.key(0), (T, D))
    ids, w = make_routing(jax.random.key(4), skew=skew, e=E)
    experts = make_experts(jax.random.key(2), e=E)
    probe = jax.random.normal(jax.random.key(3), (T, D))
    kept, send_drops, recv_drops = ragged_capacity_survivors(ids, data, ep, E, cf, chunks)
    assert recv_drops > 0, "test routing should overflow a chunk"

    def loss(x, w, experts):
        y, s = _moe(x, ids, w, experts, mesh, cf=cf, chunks=chunks)
        return jnp.sum(y * probe), s

    (value, stats), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(x, w, experts)
    assert float(stats["send_drops"]) == send_drops == 0
    assert float(stats["recv_drops"]) == recv_drops
    assert float(stats["assignments"]) == T * K
    assert_close((value, grads), reference_value_and_grad(ids, probe, kept)(x, w, experts))


def test_pooling_over_a_chunk_drops_less_than_per_expert_buffers():
    """The same balanced random routing at the same factor: pooled chunks drop far less than the
    fixed transport's per-expert buffers (the reference rules, no devices needed)."""
    rng = np.random.default_rng(0)
    t, e, k, ep = 4096, 64, 4, 8
    ids = np.stack([rng.choice(e, size=k, replace=False) for _ in range(t)])
    _, fs, fr = fixed_transport_survivors(ids, 1, ep, e, 1.15)
    _, rs, rr = ragged_capacity_survivors(ids, 1, ep, e, 1.15, 2)
    assert rs == 0 and rr < (fs + fr) / 3, (fs + fr, rr)


@needs8
def test_ragged_capacity_lowers_for_cuda_with_the_real_collective():
    """Forward and backward lower for a GPU target from CPU with the real ragged_all_to_all and the
    grouped GEMM (XLA's, named: "auto" picks capacity buffers when lowering from a CPU host)."""
    mesh = make_mesh(2, 4)
    x = jax.random.normal(jax.random.key(0), (T, D))
    ids, w = make_routing(jax.random.key(1), e=E)
    experts = make_experts(jax.random.key(2), e=E)

    def f(x, w, experts):
        return jnp.sum(_moe(x, ids, w, experts, mesh, grouped_impl="ragged_dot")[0])

    with lowering_for("cuda"):
        lowered = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2))).trace(x, w, experts).lower(
            lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "ragged_all_to_all" in text and "ragged_dot" in text.replace("ragged_dot_general", "ragged_dot")

