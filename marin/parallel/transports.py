"""Expert-parallel (EP) transports: moving each token's assignments to the devices that hold their
experts and the results back.

Every transport takes the latent activations x [T, D], each token's top-k expert ids [T, k] and
combine weights [T, k], and the routed experts' SwiGLU weights, and returns
    y [T, D] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t])      (dropped assignments contribute 0)
plus drop counts; :func:`marin.models.reference.moe_reference` is that formula written plainly, and
:func:`marin.models.reference.fixed_transport_survivors` says which assignments the fixed transport
keeps. An "assignment" is one (token, expert) pair; a token has k of them. The expert compute
itself is in :mod:`marin.kernels.grouped`.

  local     no EP: each device runs every expert on its own tokens (`grouped.routed_experts`).
  fixed     all_to_all with static buffers sized by the capacity factor (the hero run's scheme):
              sender: per destination device a pooled buffer of ceil(cf * A / ep) slots; assignments
                      past it are dropped (sender-side drops);
              receiver: per local expert a buffer of ceil(cf * expected per-expert count) slots,
                      filled round-robin over source shards (fair share); overflow is dropped
                      (receiver-side drops);
              the expert id travels as one extra column of the activation buffer (no metadata
              collective); results return by the inverse all_to_all and are combined on the sender.
  dropless  the same collective with buffers sized for the worst case (CPU-runnable, never drops);
              receiver computes with the grouped SwiGLU, so compute is not padded to the worst case.
  ragged    jax.lax.ragged_all_to_all (GPU): exactly the assignments travel; a tiny all_gather of the
              per-destination counts gives the offsets. XLA:CPU lacks the op, so when tracing for a
              CPU an exact emulation (ragged_all_to_all_emulated, worst-case all_to_all) stands in.
              Never drops; its receive buffer is sized for the worst case (ep * t * min(k, e_loc) rows).
  ragged_capacity  the published run's transport after its switch: ragged_all_to_all with one update
              per (source device, local expert) pair, so rows arrive grouped by expert; a device's
              local experts run in `expert_chunks` chunks one after the other, each chunk with one
              receive buffer of ceil(cf * expected assignments of the chunk) rows pooled over its
              experts (marin.parallel.capacity.chunk_capacity). Offsets come from one all_gather of
              the counts per (source, local expert); an update that runs past its chunk's buffer is
              cut there and the rest dropped (counted as receiver-side drops; the sender knows the
              same from the counts and combines zeros for them). Can drop, far less than `fixed` at
              the same factor: a device's load over a chunk varies far less than one expert's.

The EP transports run inside jax.shard_map over a (data, expert) mesh: tokens split over both axes,
expert weights split over "expert"; the all_to_all goes along "expert" only (one EP group per data row).
Platform choices (the emulated ragged all_to_all, and the grouped implementation when
`grouped_impl` is None or "auto": `marin.kernels.grouped.resolve_grouped_impl`) follow
`marin.jaxcompat.compute_platform()`. `local`, `dropless`, `ragged` and `ragged_capacity` compute
their experts with the named grouped implementation; `fixed` with its own per-expert buffers, whose
size the capacity factor already bounds.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from marin.jaxcompat import compute_platform, vary_like
from marin.kernels.grouped import combine, grouped_swiglu, rank_within_groups, routed_experts, swiglu_experts
from marin.parallel.capacity import (
    DEFAULT_EXPERT_CHUNKS,
    EP_TRANSPORTS,
    check_expert_chunks,
    chunk_capacity,
    recv_capacity,
    send_capacity,
)
from marin.parallel.mesh import EXPERT, TOKEN_AXES, make_mesh


def drop_stats(send_drops, recv_drops, assignments: int) -> dict:
    """The per-call drop accounting every transport returns (float32 counts; psum'd over the mesh by
    the EP transports)."""
    return {
        "send_drops": jnp.sum(send_drops).astype(jnp.float32),
        "recv_drops": jnp.sum(recv_drops).astype(jnp.float32),
        "assignments": jnp.float32(assignments),
    }


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
def _a2a_body(x, expert_ids, weights, gate, up, down, *, n_experts, ep, capacity_factor, grouped_impl=None):
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
        y_recv = grouped_swiglu(recv_x, row_expert, gate, up, down, grouped_impl,
                                expected_rows=ep * t * k / n_experts)
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
    return y, jax.lax.psum(drop_stats(send_drop, recv_drop, t * k), TOKEN_AXES)


# ---- ragged all_to_all (per-shard body; GPU) ----------------------------------------------------
def ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """Same semantics as jax.lax.ragged_all_to_all, built from a worst-case-sized all_to_all (runs on
    XLA:CPU, which lacks the real op). Update u (rows input_offsets[u] + [0, send_sizes[u]) of
    `operand`) goes to device u // (K / axis size) and lands there at rows output_offsets[u] + [0,
    send_sizes[u]) of its `output`; rows of `output` no update writes keep their value. Updates of one
    caller must not overlap in `operand` (true of every transport here)."""
    n, n_updates = operand.shape[0], send_sizes.shape[0]
    ep = jax.lax.axis_size(axis_name)
    per_peer = n_updates // ep
    i = jnp.arange(n, dtype=jnp.int32)
    member = (i[:, None] >= input_offsets[None, :]) & (i[:, None] < (input_offsets + send_sizes)[None, :])  # [n, K]
    has = jnp.any(member, axis=1)
    u = jnp.argmax(member, axis=1)
    to_peer = jnp.where(has, u // per_peer, ep)
    target = output_offsets[u] + i - input_offsets[u]
    mine = to_peer[None, :] == jnp.arange(ep, dtype=jnp.int32)[:, None]  # [ep, n]
    blocks = jnp.where(mine.reshape(mine.shape + (1,) * (operand.ndim - 1)), operand[None], 0)
    targets = jnp.where(mine, target[None, :], output.shape[0])
    got = jax.lax.all_to_all(blocks, axis_name, 0, 0)  # [ep(src), n, ...]
    got_targets = jax.lax.all_to_all(targets, axis_name, 0, 0)
    del recv_sizes  # implied by the senders' send_sizes
    # rows land where their update says (no two on one row): kept rows of `output` plus a scatter-add
    # into zeros, which is linear (its backward is a gather) where a scatter-set's differentiation
    # keeps masks the size of the rows for every call
    flat_targets = got_targets.reshape(-1)
    written = jnp.zeros(output.shape[:1], jnp.bool_).at[flat_targets].set(True, mode="drop")
    kept = jnp.where(written.reshape(written.shape + (1,) * (output.ndim - 1)), 0, output)
    return kept + jnp.zeros_like(output).at[flat_targets].add(got.reshape((ep * n,) + operand.shape[1:]),
                                                              mode="drop")


def _ragged_body(x, expert_ids, weights, gate, up, down, *, n_experts, ep, emulate, grouped_impl=None):
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
    y_recv = grouped_swiglu(recv_x, row_expert, gate, up, down, grouped_impl, expected_rows=ep * t * k / n_experts)
    # return trip: send back what I received from src to src, at the offsets src sent it from
    recv_offsets = jnp.cumsum(recv_sizes) - recv_sizes
    back_offsets = (jnp.cumsum(m, axis=1) - m)[:, me]
    back = ragged_a2a(y_recv, jnp.zeros((a, d), x.dtype), recv_offsets, recv_sizes,
                      back_offsets, send_sizes, axis_name=EXPERT)
    y_assign = jnp.zeros_like(back).at[perm].set(back)
    y = combine(y_assign, weights)
    return y, jax.lax.psum(drop_stats(0, 0, a), TOKEN_AXES)


# ---- capacity-bounded ragged all_to_all (per-shard body) ---------------------------------------
def ragged_capacity_layout(counts, chunk: int, per_chunk: int, cap: int):
    """Where each (source, local expert) update lands in every receiver's buffer for one chunk.

    counts int [ep(src), ep(dst), e_loc]: assignments each source sends to each local expert of each
    device (the all_gather'd counts). A receiver's chunk buffer holds its experts c*per_chunk ...
    one after the other, and within an expert the sources in order (rows arrive grouped by expert);
    a buffer has ``cap`` rows and an update that would run past it is cut there (the tail is
    dropped). Returns (offset, accepted), both int [ep(src), ep(dst), per_chunk]: the update's first
    row in the receiver's buffer, and how many of its rows the receiver keeps."""
    m = counts[:, :, chunk * per_chunk:(chunk + 1) * per_chunk]
    by_dst = jnp.transpose(m, (1, 2, 0))  # [dst, expert, src]: the buffer's order
    flat = by_dst.reshape(by_dst.shape[0], -1)
    start = (jnp.cumsum(flat, axis=1) - flat).reshape(by_dst.shape)
    offset = jnp.transpose(start, (2, 0, 1))
    accepted = jnp.clip(cap - offset, 0, m)
    return offset, accepted


def _ragged_capacity_body(x, expert_ids, weights, gate, up, down, *, n_experts, ep, capacity_factor,
                          expert_chunks, emulate, grouped_impl=None):
    t, k = expert_ids.shape
    d = x.shape[1]
    e_loc = n_experts // ep
    per_chunk = check_expert_chunks(n_experts, ep, expert_chunks)
    cap = chunk_capacity(t, k, n_experts, ep, capacity_factor, expert_chunks)
    a = t * k
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    perm = jnp.argsort(flat, stable=True)  # grouped by (device, local expert): the global expert id
    payload = jnp.repeat(x, k, axis=0)[perm]  # no id column: the counts say which rows are whose
    mine = jnp.zeros((n_experts,), jnp.int32).at[flat].add(1).reshape(ep, e_loc)
    counts = jax.lax.all_gather(mine, EXPERT)  # [src, dst, e_loc]: the only metadata
    me = jax.lax.axis_index(EXPERT)
    starts = (jnp.cumsum(counts.reshape(ep, -1), axis=1) - counts.reshape(ep, -1)).reshape(counts.shape)
    ragged_a2a = ragged_all_to_all_emulated if emulate else jax.lax.ragged_all_to_all
    back = vary_like(jnp.zeros((a, d), x.dtype), payload)  # threaded through every chunk's return trip
    dropped = jnp.zeros((), jnp.int32)
    for c in range(expert_chunks):  # one after the other: one chunk's buffer at a time
        offset, accepted = ragged_capacity_layout(counts, c, per_chunk, cap)
        sl = slice(c * per_chunk, (c + 1) * per_chunk)
        # dispatch: my update (dst, e) to dst, landing where dst's buffer has room for it
        recv = ragged_a2a(payload, vary_like(jnp.zeros((cap, d), x.dtype), payload), starts[me][:, sl].reshape(-1),
                          accepted[me].reshape(-1), offset[me].reshape(-1), accepted[:, me].reshape(-1),
                          axis_name=EXPERT)
        group = jnp.sum(accepted[:, me], axis=0)  # rows per local expert of the chunk, in buffer order
        row_expert = jnp.searchsorted(jnp.cumsum(group), jnp.arange(cap, dtype=jnp.int32), side="right")
        y = grouped_swiglu(recv, row_expert, gate[sl], up[sl], down[sl], grouped_impl,
                           expected_rows=cap / per_chunk)
        # combine: each update goes back to its source, at the rows it was sent from
        back = ragged_a2a(y, back, offset[:, me].reshape(-1), accepted[:, me].reshape(-1),
                          starts[:, me, sl].reshape(-1), accepted[me].reshape(-1), axis_name=EXPERT)
        dropped = dropped + jnp.sum(counts[:, me, sl]) - jnp.sum(accepted[:, me])
    y_assign = jnp.zeros_like(back).at[perm].set(back)
    return combine(y_assign, weights), jax.lax.psum(drop_stats(0, dropped, a), TOKEN_AXES)


def _ep_moe(x, expert_ids, weights, experts, mesh, *, n_experts: int, transport: str, capacity_factor: float,
            expert_chunks: int = DEFAULT_EXPERT_CHUNKS, grouped_impl: str | None = None):
    """Expert-parallel routed experts over `mesh` (axes data, expert). x [T, D] with T divisible by
    the number of devices; expert weights [E, ...] with E divisible by the expert axis size."""
    ep = mesh.shape[EXPERT]
    if n_experts % ep:
        raise ValueError(f"n_experts={n_experts} is not divisible by the expert axis size {ep}")
    emulate = compute_platform() == "cpu"
    if transport == "ragged":
        body = partial(_ragged_body, n_experts=n_experts, ep=ep, emulate=emulate, grouped_impl=grouped_impl)
    elif transport == "ragged_capacity":
        body = partial(_ragged_capacity_body, n_experts=n_experts, ep=ep, capacity_factor=capacity_factor,
                       expert_chunks=expert_chunks, emulate=emulate, grouped_impl=grouped_impl)
    elif transport in ("fixed", "dropless"):
        cf = capacity_factor if transport == "fixed" else None
        body = partial(_a2a_body, n_experts=n_experts, ep=ep, capacity_factor=cf, grouped_impl=grouped_impl)
    else:
        raise ValueError(f"unknown EP transport {transport!r}; choose from {EP_TRANSPORTS}")
    tok = P(TOKEN_AXES)
    wspec = P(EXPERT)
    f = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, wspec, wspec, wspec), out_specs=(tok, P()))
    return f(x, expert_ids, weights, experts["gate"], experts["up"], experts["down"])


def _local(x, expert_ids, weights, experts, grouped_impl=None):
    return routed_experts(x, expert_ids, weights, experts, grouped_impl), drop_stats(0, 0, expert_ids.size)


def _local_on_mesh(x, expert_ids, weights, experts, mesh, grouped_impl=None):
    """`_local` per device inside shard_map: explicit per-device work, so the CPU kernel's custom
    call (which the automatic partitioner cannot split) runs on each device's own tokens."""

    def body(x, ids, w, gate, up, down):
        y, stats = _local(x, ids, w, {"gate": gate, "up": up, "down": down}, grouped_impl)
        return y, jax.tree.map(lambda s: jax.lax.psum(s, TOKEN_AXES), stats)

    tok, rep = P(TOKEN_AXES), P()
    f = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, rep, rep, rep), out_specs=(tok, rep))
    return f(x, expert_ids, weights, experts["gate"], experts["up"], experts["down"])


def moe_experts(x, expert_ids, weights, experts, *, n_experts: int, transport: str, mesh=None,
                capacity_factor: float = 1.15, expert_chunks: int = DEFAULT_EXPERT_CHUNKS,
                grouped_impl: str | None = None):
    """The routed experts of the MoE block through `transport`: x [T, D], expert_ids int [T, k],
    weights [T, k], experts {"gate", "up", "down"} [E, ...] -> (y [T, D], drop stats: send_drops,
    recv_drops, assignments, summed over the mesh).

    transport "local" on a mesh of several devices: every device runs all experts on its own tokens
    (expert weights gathered; a data-parallel baseline, no EP); an EP transport without a mesh runs on
    a 1 x 1 mesh of the first device (same drop semantics, ep = 1). ``grouped_impl`` names the
    grouped expert compute (`marin.kernels.grouped.GROUPED_IMPLS`; None or "auto": the platform's
    rule); it changes float summation order only."""
    if transport == "local":
        if mesh is None or mesh.size == 1:
            return _local(x, expert_ids, weights, experts, grouped_impl)
        return _local_on_mesh(x, expert_ids, weights, experts, mesh, grouped_impl)
    if mesh is None:
        mesh = make_mesh(1, 1)
    return _ep_moe(x, expert_ids, weights, experts, mesh, n_experts=n_experts, transport=transport,
                   capacity_factor=capacity_factor, expert_chunks=expert_chunks, grouped_impl=grouped_impl)


__all__ = [
    "moe_experts",
    "drop_stats",
    "send_capacity",
    "recv_capacity",
    "sender_layout",
    "receiver_layout",
    "ragged_all_to_all_emulated",
    "ragged_capacity_layout",
]
