"""Routed-expert computation and the expert-parallel (EP) transports.

Every transport takes the latent activations x [T, D], each token's top-k expert ids [T, k] and
combine weights [T, k], and the routed experts' SwiGLU weights, and returns
    y [T, D] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t])      (dropped assignments contribute 0)
plus drop counts. An "assignment" is one (token, expert) pair; a token has k of them.

  local     one device: assignments sorted by expert, grouped matmul. The reference fast path (on CPU
              `capacity_moe`: dispatch gather, batched SwiGLU and weighted combine in one custom VJP).
  fixed     all_to_all with static buffers sized by the capacity factor (the hero run's scheme):
              sender: per destination device a pooled buffer of ceil(cf * A / ep) slots; assignments
                      past it are dropped (sender-side drops);
              receiver: per local expert a buffer of ceil(cf * expected per-expert count) slots,
                      filled round-robin over source shards (fair share); overflow is dropped
                      (receiver-side drops);
              the expert id travels as one extra column of the activation buffer (no metadata
              collective); results return by the inverse all_to_all and are combined on the sender.
  dropless  the same collective with buffers sized for the worst case (CPU-runnable, never drops);
              receiver computes with the grouped matmul, so compute is not padded to the worst case.
  ragged    jax.lax.ragged_all_to_all (GPU): exactly the assignments travel; a tiny all_gather of the
              per-destination counts gives the offsets. XLA:CPU lacks the op, so on a CPU mesh an
              exact emulation (ragged_all_to_all_emulated, worst-case all_to_all) stands in.

The EP transports run inside jax.shard_map over a (data, expert) mesh: tokens split over both axes,
expert weights split over "expert"; the all_to_all goes along "expert" only (one EP group per data row).
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from marin.jaxcompat import compute_platform, sum_to_type_of, vary_like
from marin.kernels.cpu import swiglu_bwd, swiglu_fwd, swiglu_reference, use_kernel
from marin.models.config import TRANSPORTS
from marin.parallel.mesh import DATA, EXPERT, TOKEN_AXES

EP_TRANSPORTS = tuple(t for t in TRANSPORTS if t != "local")  # the ones that move tokens between devices


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


def _block_size(n_rows: int, n_groups: int) -> int:
    """Rows per block in the blocked grouped matmul: about an eighth of the mean group, 16..256."""
    b = max(1, n_rows // (8 * max(1, n_groups)))
    return int(min(256, max(16, 2 ** int(math.log2(b)))))


@jax.custom_vjp
def block_matmul(xb, block_expert, n_used, w):
    """out[i] = xb[i] @ w[block_expert[i]] for blocks i < n_used, 0 after. xb [n, blk, K], w [E, K, N].

    A loop over the used blocks only (padding blocks cost nothing). The custom VJP accumulates the
    weight gradient in place, per expert: plain autodiff of a gather (or of a loop) would materialise
    per-block [n, K, N] partial gradients, which on CPU cost more than the matmuls."""
    n, blk, _ = xb.shape

    def body(i, out):
        return jax.lax.dynamic_update_index_in_dim(out, xb[i] @ w[block_expert[i]], i, 0)

    out = vary_like(jnp.zeros((n, blk, w.shape[-1]), xb.dtype), xb, w, block_expert, n_used)
    return jax.lax.fori_loop(0, n_used, body, out)


def _block_matmul_fwd(xb, block_expert, n_used, w):
    return block_matmul(xb, block_expert, n_used, w), (xb, block_expert, n_used, w)


def _block_matmul_bwd(res, dy):
    xb, block_expert, n_used, w = res

    def body(i, carry):
        dx, dw = carry
        e = block_expert[i]
        dx = jax.lax.dynamic_update_index_in_dim(dx, dy[i] @ w[e].T, i, 0)
        dw_e = jax.lax.dynamic_index_in_dim(dw, e, 0, keepdims=False) + xb[i].T @ dy[i]
        return dx, jax.lax.dynamic_update_index_in_dim(dw, dw_e, e, 0)

    refs = (xb, w, dy, block_expert, n_used)
    init = (vary_like(jnp.zeros_like(xb), *refs), vary_like(jnp.zeros_like(w), *refs))
    dx, dw = jax.lax.fori_loop(0, n_used, body, init)
    return sum_to_type_of(dx, xb), None, None, sum_to_type_of(dw, w)


block_matmul.defvjp(_block_matmul_fwd, _block_matmul_bwd)


# ---- capacity-padded grouped SwiGLU (CPU default) ---------------------------------------------
CAPACITY_BUCKETS = (
    1.03125,
    1.0625,
    1.09375,
    1.125,
    1.1875,
    1.25,
    1.5,
    2.0,
)  # per-expert buffer sizes, x the expected rows


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


def _sum_rounds(n_rounds, one_round):
    """The sum over rounds r < n_rounds (traced, >= 1) of one_round(r), a tuple of arrays.

    Round 0 is peeled off the loop: in the usual one-round case nothing is zero-filled and nothing
    is accumulated (on XLA:CPU each of those is a full memory pass over [T*k, F]-sized arrays)."""
    def body(r, acc):
        return tuple(a + c for a, c in zip(acc, one_round(r)))

    return jax.lax.fori_loop(1, n_rounds, body, one_round(0))


def _cap_fwd_rounds(cap, rows, row_expert, plan, w_gate, w_up, w_down):
    d = rows.shape[1]
    n_exp, _, f = w_gate.shape

    def one_round(r):
        slot, fill = plan.slots(row_expert, n_exp, cap, r), plan.filled(cap, r)
        xb = _to_buf(rows, _slot_source(slot, n_exp * cap)).reshape(n_exp, cap, d)
        yb, g, u = swiglu_fwd(xb, w_gate, w_up, w_down, fill)
        return tuple(_from_buf(a, slot) for a in (yb.reshape(-1, d), g.reshape(-1, f), u.reshape(-1, f)))

    return _sum_rounds(plan.n_rounds, one_round)


def _cap_bwd_rounds(cap, rows, row_expert, plan, w_gate, w_up, w_down, g_rows, u_rows, dy):
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

    return _sum_rounds(plan.n_rounds, one_round)


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
    branches = [partial(_cap_fwd_rounds, c) for c in buckets]
    y, g_rows, u_rows = jax.lax.switch(idx, branches, rows, row_expert, plan, w_gate, w_up, w_down)
    return y, (rows, row_expert, plan, idx, w_gate, w_up, w_down, g_rows, u_rows)


def _capacity_bwd(buckets, res, dy):
    rows, row_expert, plan, idx, w_gate, w_up, w_down, g_rows, u_rows = res
    branches = [partial(_cap_bwd_rounds, c) for c in buckets]
    dx, dwg, dwu, dwd = jax.lax.switch(idx, branches, rows, row_expert, plan, w_gate, w_up, w_down,
                                       g_rows, u_rows, dy)
    return (sum_to_type_of(dx, rows), None, sum_to_type_of(dwg, w_gate), sum_to_type_of(dwu, w_up),
            sum_to_type_of(dwd, w_down))


capacity_swiglu.defvjp(_capacity_fwd, _capacity_bwd)


def grouped_swiglu(rows, row_expert, w_gate, w_up, w_down, impl: str | None = None,
                   expected_rows: float | None = None):
    """rows [N, D]; row_expert int [N] in [0, E] (E = skip the row). Returns [N, D], 0 for skipped.

    impl "capacity" (CPU default): `capacity_swiglu`, batched matmuls over per-expert buffers sized
                   from `expected_rows` per expert (default N / E; pass the real expectation when
                   most rows are skipped, e.g. a worst-case receive buffer).

    impl "blocks": rows sorted by expert into expert-aligned blocks (padding < one block per expert),
                   then `block_matmul` over the used blocks. For CPU, where lax.ragged_dot is a dense
                   masked matmul over all groups (E x the work).
    impl "ragged": jax.lax.ragged_dot on rows sorted by expert (the GPU / TPU grouped GEMM).
    """
    if impl is None:
        impl = "capacity" if compute_platform() == "cpu" else "ragged"
    n, d = rows.shape
    n_exp = w_gate.shape[0]
    row_expert = row_expert.astype(jnp.int32)
    if impl == "capacity":
        expected = n / n_exp if expected_rows is None else expected_rows
        return capacity_swiglu(capacity_buckets(expected), rows, row_expert, w_gate, w_up, w_down)
    valid = row_expert < n_exp
    if impl == "ragged":
        perm = jnp.argsort(row_expert, stable=True)
        counts = jnp.zeros((n_exp + 1,), jnp.int32).at[row_expert].add(1)[:n_exp]
        xs = rows[perm]
        g = jax.lax.ragged_dot(xs, w_gate, counts)
        u = jax.lax.ragged_dot(xs, w_up, counts)
        ys = jax.lax.ragged_dot(jax.nn.silu(g) * u, w_down, counts)
        y = jnp.zeros_like(ys).at[perm].set(ys)
        return jnp.where(valid[:, None], y, 0)
    if impl != "blocks":
        raise ValueError(f"unknown grouped matmul impl {impl!r}")
    blk = _block_size(n, n_exp)
    rank, counts = rank_within_groups(row_expert, n_exp)
    padded = (counts + blk - 1) // blk * blk
    pend = jnp.cumsum(padded)
    pstart = pend - padded
    n_blocks = -(-n // blk) + n_exp  # static upper bound on the used blocks, sum(padded) / blk
    n_used = pend[-1] // blk
    dest = jnp.where(valid, pstart[jnp.minimum(row_expert, n_exp - 1)] + rank, n_blocks * blk)
    xb = jnp.zeros((n_blocks * blk, d), rows.dtype).at[dest].set(rows, mode="drop").reshape(n_blocks, blk, d)
    block_expert = jnp.minimum(jnp.searchsorted(pend, jnp.arange(n_blocks, dtype=jnp.int32) * blk, side="right"),
                               n_exp - 1)
    h = jax.nn.silu(block_matmul(xb, block_expert, n_used, w_gate)) * block_matmul(xb, block_expert, n_used, w_up)
    yb = block_matmul(h, block_expert, n_used, w_down)
    return yb.reshape(n_blocks * blk, d).at[dest].get(mode="fill", fill_value=0)


def combine(y_assign, weights):
    """y_assign [T*k, D] in (token, slot) order, weights [T, k] -> [T, D]."""
    t, k = weights.shape
    # elementwise multiply + sum: a "tkd,tk->td" einsum becomes T tiny batched dots on CPU
    return jnp.sum(y_assign.reshape(t, k, -1) * weights.astype(y_assign.dtype)[:, :, None], axis=1)


# ---- fused local routed path (capacity buffers filled from the tokens; weighted combine) --------
def _fused_fwd_rounds(cap, x, weights, flat, plan, w_gate, w_up, w_down):
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

    return _sum_rounds(plan.n_rounds, one_round)


def _fused_bwd_rounds(cap, x, weights, flat, plan, w_gate, w_up, w_down, g_rows, u_rows, dy):
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

    return _sum_rounds(plan.n_rounds, one_round)


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
    branches = [partial(_fused_fwd_rounds, c) for c in buckets]
    y, g_rows, u_rows = jax.lax.switch(idx, branches, x, weights, flat, plan, w_gate, w_up, w_down)
    return y, (x, weights, flat, plan, idx, w_gate, w_up, w_down, g_rows, u_rows)


def _capacity_moe_bwd(buckets, res, dy):
    x, weights, flat, plan, idx, w_gate, w_up, w_down, g_rows, u_rows = res
    branches = [partial(_fused_bwd_rounds, c) for c in buckets]
    dx, dwt, dwg, dwu, dwd = jax.lax.switch(idx, branches, x, weights, flat, plan, w_gate, w_up, w_down,
                                            g_rows, u_rows, dy)
    return (sum_to_type_of(dx, x), None, sum_to_type_of(dwt.reshape(weights.shape), weights),
            sum_to_type_of(dwg, w_gate), sum_to_type_of(dwu, w_up), sum_to_type_of(dwd, w_down))


capacity_moe.defvjp(_capacity_moe_fwd, _capacity_moe_bwd)


# ---- local ----------------------------------------------------------------------------------
def local_moe(x, expert_ids, weights, experts, impl=None):
    t, k = expert_ids.shape
    if impl == "fused" or (impl is None and compute_platform() == "cpu"):  # CPU: the fused capacity path
        y = capacity_moe(capacity_buckets(t * k / experts["gate"].shape[0]), x, expert_ids,
                         weights.astype(x.dtype), experts["gate"], experts["up"], experts["down"])
        zero = jnp.zeros((), jnp.float32)
        return y, {"send_drops": zero, "recv_drops": zero, "assignments": jnp.float32(t * k)}
    y = grouped_swiglu(
        jnp.repeat(x, k, axis=0), expert_ids.reshape(-1), experts["gate"], experts["up"], experts["down"], impl
    )
    zero = jnp.zeros((), jnp.float32)
    return combine(y, weights), {"send_drops": zero, "recv_drops": zero, "assignments": jnp.float32(t * k)}


# ---- capacities (static ints; pure) ---------------------------------------------------------
def send_capacity(tokens_per_shard: int, top_k: int, n_experts: int, ep: int, capacity_factor: float | None):
    """Slots per destination device in a sender's buffer. None = worst case (dropless)."""
    worst = tokens_per_shard * min(top_k, n_experts // ep)
    if capacity_factor is None:
        return worst
    return min(worst, math.ceil(capacity_factor * tokens_per_shard * top_k / ep))


def recv_capacity(tokens_per_shard: int, top_k: int, n_experts: int, ep: int, capacity_factor: float | None):
    """Slots per local expert in a receiver's buffer: cf x the expected per-expert count of a wave."""
    worst = ep * tokens_per_shard
    if capacity_factor is None:
        return worst
    return min(worst, math.ceil(capacity_factor * ep * tokens_per_shard * top_k / n_experts))


# ---- the sender and receiver layouts (pure, shared by the fixed and dropless transports) -----
def sender_layout(expert_ids, n_experts: int, ep: int, cap_send: int):
    """Where each assignment goes in the send buffer [ep * cap_send]: slot (or ep * cap_send if
    dropped), its local expert id at the destination, and the sender-side drop mask.
    Within a destination, assignments keep (token, slot) order; the first cap_send are sent."""
    e_loc = n_experts // ep
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    dest = flat // e_loc
    rank, _ = rank_within_groups(dest, ep)
    keep = rank < cap_send
    slot = jnp.where(keep, dest * cap_send + rank, ep * cap_send)
    return slot, flat % e_loc, ~keep


def receiver_layout(recv_ids, e_loc: int, cap_recv: int):
    """recv_ids int [ep, S]: local expert of each received slot (-1 = empty). Each local expert has
    cap_recv buffer rows, filled round-robin over sources: a slot that is the r-th for its expert in
    source s is ordered by (r, s). Returns buffer row per slot (e_loc * cap_recv if dropped/empty)
    and the receiver-side drop mask."""
    ep, s = recv_ids.shape
    ids = recv_ids.reshape(-1)
    valid = ids >= 0
    src = jnp.repeat(jnp.arange(ep, dtype=jnp.int32), s)
    e = jnp.where(valid, ids, e_loc)
    r, _ = rank_within_groups(jnp.where(valid, src * e_loc + e, ep * e_loc), ep * e_loc)
    pos, _ = rank_within_groups(e, e_loc, key=jnp.where(valid, r * ep + src, 0))
    keep = valid & (pos < cap_recv)
    row = jnp.where(keep, e * cap_recv + pos, e_loc * cap_recv)
    return row, valid & ~keep


# ---- payload: the expert id rides as one extra column of the activations ------------------------
def _pack(x, local_ids):
    # ids as exact small floats: id + 1, so an all-zero (empty) slot decodes to -1
    col = (local_ids + 1).astype(x.dtype)[:, None]
    return jnp.concatenate([x, jax.lax.stop_gradient(col)], axis=1)


def _unpack(buf):
    ids = jnp.round(jax.lax.stop_gradient(buf[..., -1]).astype(jnp.float32)).astype(jnp.int32) - 1
    return buf[..., :-1], ids


# ---- fixed-buffer / dropless all_to_all (per-shard body) --------------------------------------
def _a2a_body(x, expert_ids, weights, gate, up, down, *, n_experts, ep, capacity_factor, impl):
    t, k = expert_ids.shape
    d = x.shape[1]
    e_loc = n_experts // ep
    if x.dtype == jnp.bfloat16 and e_loc > 255:
        raise ValueError("bf16 payload encodes local expert ids exactly only up to 255 per device")
    cap_send = send_capacity(t, k, n_experts, ep, capacity_factor)
    slot, local_ids, send_drop = sender_layout(expert_ids, n_experts, ep, cap_send)
    payload = _pack(jnp.repeat(x, k, axis=0), local_ids)
    send = jnp.zeros((ep * cap_send, d + 1), x.dtype).at[slot].set(payload, mode="drop")
    # wave 1: dispatch
    recv = jax.lax.all_to_all(send.reshape(ep, cap_send, d + 1), EXPERT, 0, 0)
    recv_x, recv_ids = _unpack(recv)
    recv_x = recv_x.reshape(ep * cap_send, d)
    # wave 2: expert compute
    if capacity_factor is None:  # dropless: grouped matmul over the valid slots
        row_expert = jnp.where(recv_ids >= 0, recv_ids, e_loc).reshape(-1)
        y_recv = grouped_swiglu(recv_x, row_expert, gate, up, down, impl, expected_rows=ep * t * k / n_experts)
        recv_drop = jnp.zeros((), jnp.bool_)
    else:
        cap_recv = recv_capacity(t, k, n_experts, ep, capacity_factor)
        row, recv_drop = receiver_layout(recv_ids, e_loc, cap_recv)
        buf = jnp.zeros((e_loc * cap_recv, d), x.dtype).at[row].set(recv_x, mode="drop")
        y_buf = swiglu_experts(buf.reshape(e_loc, cap_recv, d), gate, up, down)
        y_recv = y_buf.reshape(e_loc * cap_recv, d).at[row].get(mode="fill", fill_value=0)
    # wave 3: combine (results go back to the senders)
    back = jax.lax.all_to_all(y_recv.reshape(ep, cap_send, d), EXPERT, 0, 0).reshape(ep * cap_send, d)
    y_assign = back.at[slot].get(mode="fill", fill_value=0)
    y = combine(y_assign, weights)
    stats = {
        "send_drops": jnp.sum(send_drop).astype(jnp.float32),
        "recv_drops": jnp.sum(recv_drop).astype(jnp.float32),
        "assignments": jnp.float32(t * k),
    }
    return y, jax.lax.psum(stats, TOKEN_AXES)


# ---- ragged all_to_all (per-shard body; GPU) ----------------------------------------------------
def ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """Same semantics as jax.lax.ragged_all_to_all, built from a worst-case-sized all_to_all (runs on
    XLA:CPU, which lacks the real op). Chunk j of `operand` (rows input_offsets[j] + [0, send_sizes[j]))
    lands on device j at rows output_offsets[j] + [0, send_sizes[j]) (offsets in the receiver's output)."""
    n, ep = operand.shape[0], send_sizes.shape[0]
    i = jnp.arange(n, dtype=jnp.int32)
    src_rows = jnp.clip(input_offsets[:, None] + i[None, :], 0, n - 1)  # [ep, n]
    chunks = jnp.where((i[None, :] < send_sizes[:, None])[..., None], operand[src_rows], 0)
    got = jax.lax.all_to_all(chunks, axis_name, 0, 0)  # [ep(src), n, ...]
    meta = jax.lax.all_to_all(jnp.stack([output_offsets, send_sizes], axis=1), axis_name, 0, 0)  # [ep(src), 2]
    dest = jnp.where(i[None, :] < meta[:, 1:2], meta[:, 0:1] + i[None, :], output.shape[0])
    del recv_sizes  # implied by the senders' send_sizes
    return output.at[dest.reshape(-1)].set(got.reshape((ep * n,) + operand.shape[1:]), mode="drop")


def _ragged_body(x, expert_ids, weights, gate, up, down, *, n_experts, ep, impl, emulate):
    t, k = expert_ids.shape
    d = x.shape[1]
    e_loc = n_experts // ep
    a = t * k
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    dest = flat // e_loc
    perm = jnp.argsort(dest, stable=True)
    send_sizes = jnp.zeros((ep,), jnp.int32).at[dest].add(1)
    input_offsets = jnp.cumsum(send_sizes) - send_sizes
    payload = _pack(jnp.repeat(x, k, axis=0), flat % e_loc)[perm]
    # the only metadata: counts matrix m[src, dst] (ep x ep ints)
    m = jax.lax.all_gather(send_sizes, EXPERT)
    me = jax.lax.axis_index(EXPERT)
    recv_sizes = m[:, me]
    output_offsets = (jnp.cumsum(m, axis=0) - m)[me]  # where my chunk lands on each receiver
    cap = ep * t * min(k, e_loc)  # worst case rows received
    ragged_a2a = ragged_all_to_all_emulated if emulate else jax.lax.ragged_all_to_all
    recv = ragged_a2a(payload, jnp.zeros((cap, d + 1), x.dtype), input_offsets, send_sizes,
                                     output_offsets, recv_sizes, axis_name=EXPERT)
    recv_x, recv_ids = _unpack(recv)
    n_recv = jnp.sum(recv_sizes)
    row_expert = jnp.where(jnp.arange(cap) < n_recv, recv_ids, e_loc)
    y_recv = grouped_swiglu(recv_x, row_expert, gate, up, down, impl, expected_rows=ep * t * k / n_experts)
    # return trip: send back what I received from src to src, at the offsets src sent it from
    recv_offsets = jnp.cumsum(recv_sizes) - recv_sizes
    back_offsets = (jnp.cumsum(m, axis=1) - m)[:, me]
    back = ragged_a2a(y_recv, jnp.zeros((a, d), x.dtype), recv_offsets, recv_sizes,
                                     back_offsets, send_sizes, axis_name=EXPERT)
    y_assign = jnp.zeros_like(back).at[perm].set(back)
    y = combine(y_assign, weights)
    zero = jnp.zeros((), jnp.float32)
    stats = {"send_drops": zero, "recv_drops": zero, "assignments": jnp.float32(a)}
    return y, jax.lax.psum(stats, TOKEN_AXES)


def ep_moe(x, expert_ids, weights, experts, mesh, *, n_experts: int, transport: str,
           capacity_factor: float = 1.15, impl: str | None = None, emulate_ragged: bool | None = None):
    """Expert-parallel routed experts over `mesh` (axes data, expert). x [T, D] with T divisible by
    the number of devices; expert weights [E, ...] with E divisible by the expert axis size.
    emulate_ragged: build ragged_all_to_all from all_to_all (default: on CPU, where XLA lacks it)."""
    ep = mesh.shape[EXPERT]
    if n_experts % ep:
        raise ValueError(f"n_experts={n_experts} is not divisible by the expert axis size {ep}")
    if transport == "ragged":
        if emulate_ragged is None:
            emulate_ragged = compute_platform() == "cpu"
        body = partial(_ragged_body, n_experts=n_experts, ep=ep, impl=impl, emulate=emulate_ragged)
    elif transport in ("fixed", "dropless"):
        cf = capacity_factor if transport == "fixed" else None
        body = partial(_a2a_body, n_experts=n_experts, ep=ep, capacity_factor=cf, impl=impl)
    else:
        raise ValueError(f"unknown EP transport {transport!r}; choose from {EP_TRANSPORTS}")
    tok = P(TOKEN_AXES)
    wspec = P(EXPERT)
    f = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, wspec, wspec, wspec), out_specs=(tok, P()))
    return f(x, expert_ids, weights, experts["gate"], experts["up"], experts["down"])


def _local_on_mesh(x, expert_ids, weights, experts, mesh, impl):
    """`local_moe` per device inside shard_map: explicit per-device work, so the CPU kernel's custom
    call (which the automatic partitioner cannot split) runs on each device's own tokens."""

    def body(x, ids, w, gate, up, down):
        y, stats = local_moe(x, ids, w, {"gate": gate, "up": up, "down": down}, impl)
        return y, jax.tree.map(lambda s: jax.lax.psum(s, TOKEN_AXES), stats)

    tok, rep = P(TOKEN_AXES), P()
    f = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, rep, rep, rep), out_specs=(tok, rep))
    return f(x, expert_ids, weights, experts["gate"], experts["up"], experts["down"])


def moe_experts(x, expert_ids, weights, experts, *, n_experts: int, transport: str, mesh=None,
                capacity_factor: float = 1.15, impl: str | None = None):
    """Dispatch to a transport. transport "local" on a mesh of several devices: every device runs all
    experts on its own tokens (expert weights gathered; a data-parallel baseline, no EP); an EP
    transport without a mesh runs on a 1 x 1 mesh of the first device (same drop semantics, ep = 1)."""
    if transport == "local":
        if mesh is None or mesh.size == 1:
            return local_moe(x, expert_ids, weights, experts, impl)
        return _local_on_mesh(x, expert_ids, weights, experts, mesh, impl)
    if mesh is None:
        from marin.parallel.mesh import make_mesh

        mesh = make_mesh(1, 1)
    return ep_moe(x, expert_ids, weights, experts, mesh, n_experts=n_experts, transport=transport,
                  capacity_factor=capacity_factor, impl=impl)


__all__ = [
    "moe_experts",
    "ep_moe",
    "local_moe",
    "grouped_swiglu",
    "capacity_swiglu",
    "capacity_moe",
    "swiglu_experts",
    "rank_within_groups",
    "sender_layout",
    "receiver_layout",
    "send_capacity",
    "recv_capacity",
    "DATA",
]
