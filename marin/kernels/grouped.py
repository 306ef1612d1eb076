"""Grouped expert compute on one device: each row (or token) through the SwiGLU of its own expert.

    y[t] = sum_j weights[t, j] * SwiGLU_{expert_ids[t, j]}(x[t])

with the plain definition in :func:`marin.models.reference.moe_reference`; everything here computes
exactly that (no drops), faster. The transports (:mod:`marin.parallel.transports`) move tokens to
the device that holds their experts and call these on what arrives.

  capacity  (CPU) rows go into per-expert buffers [E, C, D] whose size C is picked at run time from
            static buckets, and the SwiGLU runs as batched matmuls over them (marin's CPU kernels).
            `capacity_swiglu` for rows with an expert id each (the EP receivers); `capacity_moe`
            fuses dispatch gather, SwiGLU and weighted combine for the tokens of one device.
  ragged    (GPU / TPU) rows sorted by expert, `jax.lax.ragged_dot` (the grouped GEMM).
  `swiglu_experts`: the SwiGLU over buffers that are already per expert (the fixed transport's
            receivers).

Which implementation runs follows `marin.jaxcompat.compute_platform()`, so a CPU-only machine traces
the GPU program when lowering for CUDA.

This lives in `marin.kernels`, not next to the model in `marin.models`, because the transports
(`marin.parallel`, a floor below `marin.models`) call it on what arrives, and a package imports only
from its own floor or below.
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from marin.jaxcompat import compute_platform, sum_to_type_of
from marin.kernels.cpu import swiglu_bwd, swiglu_fwd, swiglu_reference, use_kernel

GROUPED_IMPLS = ("capacity", "ragged")


def default_impl() -> str:
    """The grouped-compute implementation for the platform being traced: capacity buffers on CPU
    (where `ragged_dot` is a dense masked matmul over all groups, E times the work), `ragged_dot`
    elsewhere."""
    return "capacity" if compute_platform() == "cpu" else "ragged"


# ---- small pure helpers ---------------------------------------------------------------------
def rank_within_groups(group, n_groups: int, key=None):
    """For each element: its rank among the elements of the same group, ordered by (key, index).

    group int [N] in [0, n_groups]; the value n_groups is a "none" bucket. Returns (rank [N], counts
    [n_groups]). key, if given, is a non-negative int [N] with key * (n_groups + 1) fitting in int32."""
    n = group.shape[0]
    group = group.astype(jnp.int32)
    if key is None:
        perm = jnp.argsort(group, stable=True)
    else:
        kmax = jnp.max(key) + 1
        perm = jnp.argsort(group * kmax + key.astype(jnp.int32), stable=True)
    counts = jnp.zeros((n_groups + 1,), jnp.int32).at[group].add(1)
    starts = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(n, dtype=jnp.int32) - starts[group[perm]]
    rank = jnp.zeros((n,), jnp.int32).at[perm].set(rank_sorted)
    return rank, counts[:n_groups]


def swiglu_experts(x, w_gate, w_up, w_down):
    """Batched per-expert SwiGLU: x [E, C, D] -> [E, C, D] (every row computed).

    With the CPU kernels, forward and backward are one kernel call each (a custom VJP). Elsewhere it
    is plain einsums under autodiff, so remat policies such as "dots" still see and save the dots."""
    if use_kernel(x, w_gate, w_up, w_down):
        return _swiglu_experts_kernel(x, w_gate, w_up, w_down)
    return swiglu_reference(x, w_gate, w_up, w_down)


@jax.custom_vjp
def _swiglu_experts_kernel(x, w_gate, w_up, w_down):
    return _swiglu_experts_fwd(x, w_gate, w_up, w_down)[0]


def _all_rows(x):
    return jnp.full((x.shape[0],), x.shape[1], jnp.int32)


def _swiglu_experts_fwd(x, w_gate, w_up, w_down):
    y, g, u = swiglu_fwd(x, w_gate, w_up, w_down, _all_rows(x))
    return y, (x, g, u, w_gate, w_up, w_down)


def _swiglu_experts_bwd(res, dy):
    x, g, u, w_gate, w_up, w_down = res
    ones = jnp.ones(x.shape[:2], x.dtype)  # no combine weight inside the block
    dx, _, dwg, dwu, dwd = swiglu_bwd(x, dy, ones, g, u, w_gate, w_up, w_down, _all_rows(x))
    return tuple(sum_to_type_of(ct, p) for ct, p in ((dx, x), (dwg, w_gate), (dwu, w_up), (dwd, w_down)))


_swiglu_experts_kernel.defvjp(_swiglu_experts_fwd, _swiglu_experts_bwd)


# ---- capacity-padded grouped SwiGLU (CPU default) ---------------------------------------------
CAPACITY_BUCKETS = (1.125, 1.5, 2.0)
"""Per-expert buffer sizes, x the expected rows. Each is one branch of a ``lax.switch`` in the forward
and again in the backward, so each costs compile time in every MoE layer's program; the CPU kernel
skips a buffer's unfilled rows, so a coarser bucket costs little at run time. Three buckets instead
of eight cut a tiny model's train-step compile by about a fifth, and the round loop kept to the
largest bucket (:func:`_bucket_branches`) by as much again, at the same measured throughput."""


def capacity_buckets(expected_rows: float) -> tuple:
    """Static per-expert buffer sizes (multiples of 8) for `expected_rows` rows per expert."""
    return tuple(sorted({max(8, -(-math.ceil(f * expected_rows) // 8) * 8) for f in CAPACITY_BUCKETS}))


class _CapPlan(NamedTuple):
    """Where rows go in the capacity buffers: each row's rank within its expert, whether it has an
    expert, the rows per expert and the number of rounds (computed once, reused by the backward)."""

    rank: jax.Array
    valid: jax.Array
    counts: jax.Array
    n_rounds: jax.Array

    def slots(self, row_expert, n_exp: int, cap: int, r):
        """Buffer row (in [E * cap]) of each row in round r (rank in [r*cap, (r+1)*cap)); E*cap if not."""
        in_round = self.valid & (self.rank >= r * cap) & (self.rank < (r + 1) * cap)
        return jnp.where(in_round, row_expert * cap + self.rank - r * cap, n_exp * cap)

    def filled(self, cap: int, r):
        """Filled rows of each expert's buffer in round r (the rest is zero padding) [E]."""
        return jnp.clip(self.counts - r * cap, 0, cap)


def _slot_source(slot, n_slots):
    """The inverse map: for each buffer row, the input row that fills it (n = none -> zeros). An int
    scatter of N indices, so the activations move by gathers (XLA:CPU scatters rows slowly)."""
    n = slot.shape[0]
    return jnp.full((n_slots,), n, jnp.int32).at[slot].set(jnp.arange(n, dtype=jnp.int32), mode="drop")


def _to_buf(a, src):
    return jnp.take(a, src, axis=0, mode="fill", fill_value=0)


def _from_buf(buf, slot):
    return jnp.take(buf, slot, axis=0, mode="fill", fill_value=0)


def _sum_rounds(n_rounds, one_round, multi_round: bool = True):
    """The sum over rounds r < n_rounds (traced, >= 1) of one_round(r), a tuple of arrays; just
    one_round(0) when not multi_round (a branch that never needs a second round).

    Round 0 is peeled off the loop: in the usual one-round case nothing is zero-filled and nothing
    is accumulated (on XLA:CPU each of those is a full memory pass over [T*k, F]-sized arrays)."""
    if not multi_round:
        return one_round(0)

    def body(r, acc):
        return tuple(a + c for a, c in zip(acc, one_round(r)))

    return jax.lax.fori_loop(1, n_rounds, body, one_round(0))


def _bucket_branches(rounds_fn, buckets):
    """One ``lax.switch`` branch per bucket, ``rounds_fn(cap, multi_round, ...)``. Only the largest
    bucket's branch can need a second round (a smaller bucket is chosen only when it holds the busiest
    expert), so only it carries the round loop: each loop is another copy of the expert compute to
    compile."""
    return [partial(rounds_fn, c, i == len(buckets) - 1) for i, c in enumerate(buckets)]


def _cap_fwd_rounds(cap, multi_round, rows, row_expert, plan, w_gate, w_up, w_down):
    d = rows.shape[1]
    n_exp, _, f = w_gate.shape

    def one_round(r):
        slot, fill = plan.slots(row_expert, n_exp, cap, r), plan.filled(cap, r)
        xb = _to_buf(rows, _slot_source(slot, n_exp * cap)).reshape(n_exp, cap, d)
        yb, g, u = swiglu_fwd(xb, w_gate, w_up, w_down, fill)
        return tuple(_from_buf(a, slot) for a in (yb.reshape(-1, d), g.reshape(-1, f), u.reshape(-1, f)))

    return _sum_rounds(plan.n_rounds, one_round, multi_round)


def _cap_bwd_rounds(cap, multi_round, rows, row_expert, plan, w_gate, w_up, w_down, g_rows, u_rows, dy):
    d = rows.shape[1]
    n_exp, _, f = w_gate.shape

    def one_round(r):
        slot, fill = plan.slots(row_expert, n_exp, cap, r), plan.filled(cap, r)
        src = _slot_source(slot, n_exp * cap)
        xb, dyb = (_to_buf(a, src).reshape(n_exp, cap, d) for a in (rows, dy))
        g, u = (_to_buf(a, src).reshape(n_exp, cap, f) for a in (g_rows, u_rows))
        ones = jnp.ones((n_exp, cap), rows.dtype)  # a plain SwiGLU: every row's weight is 1
        dxb, _, dwg, dwu, dwd = swiglu_bwd(xb, dyb, ones, g, u, w_gate, w_up, w_down, fill)
        return _from_buf(dxb.reshape(-1, d), slot), dwg, dwu, dwd

    return _sum_rounds(plan.n_rounds, one_round, multi_round)


def _cap_plan(buckets, row_expert, n_exp) -> tuple[jax.Array, _CapPlan]:
    """The bucket index (which static buffer size) and the plan for filling it."""
    valid = row_expert < n_exp
    rank, counts = rank_within_groups(row_expert, n_exp)
    cmax = jnp.max(counts)
    caps = jnp.array(buckets, jnp.int32)
    idx = jnp.minimum(jnp.sum(cmax > caps), len(buckets) - 1)
    n_rounds = (cmax + caps[idx] - 1) // caps[idx]  # 1 unless cmax exceeds the largest bucket
    return idx, _CapPlan(rank, valid, counts, n_rounds)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def capacity_swiglu(buckets, rows, row_expert, w_gate, w_up, w_down):
    """Grouped SwiGLU as batched matmuls over per-expert buffers [E, C, D] (exact, dropless).

    C is the smallest of the static `buckets` that holds the busiest expert (chosen at run time by
    lax.switch; padding rows are zero); if none does, the largest bucket is used for several rounds
    (round r takes each expert's rows of rank [r*C, (r+1)*C)). The custom VJP keeps the gate/up
    pre-activations in row order (one shape for every bucket) and reuses the forward's sort."""
    return _capacity_fwd(buckets, rows, row_expert, w_gate, w_up, w_down)[0]


def _capacity_fwd(buckets, rows, row_expert, w_gate, w_up, w_down):
    n_exp = w_gate.shape[0]
    row_expert = row_expert.astype(jnp.int32)
    idx, plan = _cap_plan(buckets, row_expert, n_exp)
    branches = _bucket_branches(_cap_fwd_rounds, buckets)
    y, g_rows, u_rows = jax.lax.switch(idx, branches, rows, row_expert, plan, w_gate, w_up, w_down)
    return y, (rows, row_expert, plan, idx, w_gate, w_up, w_down, g_rows, u_rows)


def _capacity_bwd(buckets, res, dy):
    rows, row_expert, plan, idx, w_gate, w_up, w_down, g_rows, u_rows = res
    branches = _bucket_branches(_cap_bwd_rounds, buckets)
    dx, dwg, dwu, dwd = jax.lax.switch(idx, branches, rows, row_expert, plan, w_gate, w_up, w_down,
                                       g_rows, u_rows, dy)
    return (sum_to_type_of(dx, rows), None, sum_to_type_of(dwg, w_gate), sum_to_type_of(dwu, w_up),
            sum_to_type_of(dwd, w_down))


capacity_swiglu.defvjp(_capacity_fwd, _capacity_bwd)


# ---- grouped SwiGLU: rows with an expert id each (the EP receivers) ----------------------------
def grouped_swiglu(rows, row_expert, w_gate, w_up, w_down, impl: str | None = None,
                   expected_rows: float | None = None):
    """rows [N, D]; row_expert int [N] in [0, E] (E = skip the row). Returns [N, D], 0 for skipped.

    impl "capacity" (CPU default): `capacity_swiglu`, batched matmuls over per-expert buffers sized
                   from `expected_rows` per expert (default N / E; pass the real expectation when
                   most rows are skipped, e.g. a worst-case receive buffer).
    impl "ragged" (default elsewhere): jax.lax.ragged_dot on rows sorted by expert (the GPU / TPU
                   grouped GEMM).
    """
    impl = impl or default_impl()
    n = rows.shape[0]
    n_exp = w_gate.shape[0]
    row_expert = row_expert.astype(jnp.int32)
    if impl == "capacity":
        expected = n / n_exp if expected_rows is None else expected_rows
        return capacity_swiglu(capacity_buckets(expected), rows, row_expert, w_gate, w_up, w_down)
    if impl != "ragged":
        raise ValueError(f"unknown grouped SwiGLU impl {impl!r}; choose from {GROUPED_IMPLS}")
    valid = row_expert < n_exp
    perm = jnp.argsort(row_expert, stable=True)
    counts = jnp.zeros((n_exp + 1,), jnp.int32).at[row_expert].add(1)[:n_exp]
    xs = rows[perm]
    g = jax.lax.ragged_dot(xs, w_gate, counts)
    u = jax.lax.ragged_dot(xs, w_up, counts)
    ys = jax.lax.ragged_dot(jax.nn.silu(g) * u, w_down, counts)
    y = jnp.zeros_like(ys).at[perm].set(ys)
    return jnp.where(valid[:, None], y, 0)


def combine(y_assign, weights):
    """y_assign [T*k, D] in (token, slot) order, weights [T, k] -> [T, D]."""
    t, k = weights.shape
    # elementwise multiply + sum: a "tkd,tk->td" einsum becomes T tiny batched dots on CPU
    return jnp.sum(y_assign.reshape(t, k, -1) * weights.astype(y_assign.dtype)[:, :, None], axis=1)


# ---- fused routed path (capacity buffers filled from the tokens; weighted combine) --------------
def _fused_fwd_rounds(cap, multi_round, x, weights, flat, plan, w_gate, w_up, w_down):
    t, k = weights.shape
    d = x.shape[1]
    n_exp, _, f = w_gate.shape

    def one_round(r):
        slot, fill = plan.slots(flat, n_exp, cap, r), plan.filled(cap, r)
        src = _slot_source(slot, n_exp * cap)  # assignment index per buffer row (t*k = none)
        xb = jnp.take(x, src // k, axis=0, mode="fill", fill_value=0).reshape(n_exp, cap, d)
        yb, g, u = swiglu_fwd(xb, w_gate, w_up, w_down, fill)
        ya = _from_buf(yb.reshape(-1, d), slot).reshape(t, k, d)
        y = jnp.sum(ya * weights[:, :, None], axis=1)
        return y, _from_buf(g.reshape(-1, f), slot), _from_buf(u.reshape(-1, f), slot)

    return _sum_rounds(plan.n_rounds, one_round, multi_round)


def _fused_bwd_rounds(cap, multi_round, x, weights, flat, plan, w_gate, w_up, w_down, g_rows, u_rows, dy):
    t, k = weights.shape
    d = x.shape[1]
    n_exp, _, f = w_gate.shape
    wflat = weights.reshape(-1)

    def one_round(r):
        slot, fill = plan.slots(flat, n_exp, cap, r), plan.filled(cap, r)
        src = _slot_source(slot, n_exp * cap)
        tok = src // k
        xb = jnp.take(x, tok, axis=0, mode="fill", fill_value=0).reshape(n_exp, cap, d)
        dyb = jnp.take(dy, tok, axis=0, mode="fill", fill_value=0).reshape(n_exp, cap, d)
        wb = jnp.take(wflat, src, axis=0, mode="fill", fill_value=0).reshape(n_exp, cap)
        g, u = (_to_buf(a, src).reshape(n_exp, cap, f) for a in (g_rows, u_rows))
        dxb, dwb, dwg, dwu, dwd = swiglu_bwd(xb, dyb, wb, g, u, w_gate, w_up, w_down, fill)
        dwt = _from_buf(dwb.reshape(-1), slot)  # d combine weight of each assignment
        dx = jnp.sum(_from_buf(dxb.reshape(-1, d), slot).reshape(t, k, d), axis=1)
        return dx, dwt, dwg, dwu, dwd

    return _sum_rounds(plan.n_rounds, one_round, multi_round)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def capacity_moe(buckets, x, expert_ids, weights, w_gate, w_up, w_down):
    """y [T, D] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) over capacity buffers (exact, dropless).

    The whole routed path in one custom VJP: the per-expert buffers are filled straight from the
    tokens x [T, D] by one gather (no [T*k, D] repeat), the combine is fused with the gather back,
    and the backward reuses the same indices (gathers, no scatters of rows)."""
    return _capacity_moe_fwd(buckets, x, expert_ids, weights, w_gate, w_up, w_down)[0]


def _capacity_moe_fwd(buckets, x, expert_ids, weights, w_gate, w_up, w_down):
    n_exp = w_gate.shape[0]
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    idx, plan = _cap_plan(buckets, flat, n_exp)
    branches = _bucket_branches(_fused_fwd_rounds, buckets)
    y, g_rows, u_rows = jax.lax.switch(idx, branches, x, weights, flat, plan, w_gate, w_up, w_down)
    return y, (x, weights, flat, plan, idx, w_gate, w_up, w_down, g_rows, u_rows)


def _capacity_moe_bwd(buckets, res, dy):
    x, weights, flat, plan, idx, w_gate, w_up, w_down, g_rows, u_rows = res
    branches = _bucket_branches(_fused_bwd_rounds, buckets)
    dx, dwt, dwg, dwu, dwd = jax.lax.switch(idx, branches, x, weights, flat, plan, w_gate, w_up, w_down,
                                            g_rows, u_rows, dy)
    return (sum_to_type_of(dx, x), None, sum_to_type_of(dwt.reshape(weights.shape), weights),
            sum_to_type_of(dwg, w_gate), sum_to_type_of(dwu, w_up), sum_to_type_of(dwd, w_down))


capacity_moe.defvjp(_capacity_moe_fwd, _capacity_moe_bwd)


# ---- one device's routed experts ------------------------------------------------------------
def routed_experts(x, expert_ids, weights, experts, impl: str | None = None):
    """The routed experts of one device's tokens: x [T, D], expert_ids int [T, k], weights [T, k],
    experts {"gate", "up", "down"} [E, ...] -> y [T, D] (every assignment computed).

    impl "capacity" (CPU default): `capacity_moe`, one custom VJP from the tokens to the combined
    output; impl "ragged": the assignments repeated per slot, `grouped_swiglu`, weighted combine."""
    impl = impl or default_impl()
    t, k = expert_ids.shape
    gate, up, down = experts["gate"], experts["up"], experts["down"]
    if impl == "capacity":
        return capacity_moe(capacity_buckets(t * k / gate.shape[0]), x, expert_ids, weights.astype(x.dtype),
                            gate, up, down)
    y = grouped_swiglu(jnp.repeat(x, k, axis=0), expert_ids.reshape(-1), gate, up, down, impl)
    return combine(y, weights)


__all__ = [
    "GROUPED_IMPLS",
    "capacity_buckets",
    "capacity_moe",
    "capacity_swiglu",
    "combine",
    "default_impl",
    "grouped_swiglu",
    "rank_within_groups",
    "routed_experts",
    "swiglu_experts",
]
