"""The routed experts of the MoE block written plainly: the definitions the fast paths are tested against.

`moe_reference` is the formula every transport and grouped implementation computes (fast paths in
:mod:`marin.kernels.grouped` and :mod:`marin.parallel.transports`); `fixed_transport_survivors`
and `ragged_capacity_survivors` say which assignments the `fixed` and `ragged_capacity` transports
keep at a given capacity factor. Both are slow on
purpose (a gather of each selected expert's weights; a Python loop over shards and assignments) and
are not used by training.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from marin.parallel.capacity import (
    DEFAULT_EXPERT_CHUNKS,
    check_expert_chunks,
    chunk_capacity,
    recv_capacity,
    send_capacity,
)


def moe_reference(x, expert_ids, weights, experts, kept=None):
    """y[t] = sum_j kept[t, j] * weights[t, j] * SwiGLU_{expert_ids[t, j]}(x[t]).

    x [T, D], expert_ids int [T, k], weights [T, k], experts {"gate", "up": [E, D, F], "down": [E, F, D]};
    kept (bool [T, k], default all) zeroes dropped assignments. Differentiable in x, weights and
    experts by plain autodiff, so gradients of the fast paths are checked against it too."""
    if kept is not None:
        weights = jnp.where(jnp.asarray(kept), weights, 0)
    gate, up, down = (experts[n][expert_ids] for n in ("gate", "up", "down"))  # [T, k, ...] per assignment
    h = jax.nn.silu(jnp.einsum("td,tkdf->tkf", x, gate)) * jnp.einsum("td,tkdf->tkf", x, up)
    return jnp.einsum("tk,tkd->td", weights.astype(x.dtype), jnp.einsum("tkf,tkfd->tkd", h, down))


def fixed_transport_survivors(expert_ids, data: int, ep: int, n_experts: int, capacity_factor: float):
    """The `fixed` transport's drop rule, one assignment at a time, on a (data, ep) mesh whose devices
    each hold T / (data * ep) consecutive tokens. Returns (kept bool [T, k], sender drops, receiver
    drops).

    Sender: per destination device, assignments in (token, slot) order; those past the send capacity
    are dropped. Receiver: per local expert, what arrived is taken round-robin over source devices
    (the r-th of every source before any (r+1)-th), and those past the receive capacity are dropped."""
    ids = np.asarray(expert_ids)
    t_all, k = ids.shape
    t_loc = t_all // (data * ep)
    e_loc = n_experts // ep
    cap_send = send_capacity(t_loc, k, n_experts, ep, capacity_factor)
    cap_recv = recv_capacity(t_loc, k, n_experts, ep, capacity_factor)
    kept = np.zeros(ids.shape, bool)
    send_drops = recv_drops = 0
    for g in range(data):
        sent = {}  # (dest, local expert) -> {source: [assignments in send order]}
        for s in range(ep):
            shard = g * ep + s
            per_dest = {}
            for t in range(shard * t_loc, (shard + 1) * t_loc):
                for j in range(k):
                    per_dest.setdefault(ids[t, j] // e_loc, []).append((t, j))
            for dest, lst in per_dest.items():
                send_drops += max(0, len(lst) - cap_send)
                for t, j in lst[:cap_send]:
                    sent.setdefault((dest, ids[t, j] % e_loc), {}).setdefault(s, []).append((t, j))
        for by_src in sent.values():
            order = []  # round robin over sources: r-th of every source before any (r+1)-th
            for r in range(max(len(v) for v in by_src.values())):
                for s in range(ep):
                    if s in by_src and r < len(by_src[s]):
                        order.append(by_src[s][r])
            recv_drops += max(0, len(order) - cap_recv)
            for t, j in order[:cap_recv]:
                kept[t, j] = True
    return kept, send_drops, recv_drops


def ragged_capacity_survivors(expert_ids, data: int, ep: int, n_experts: int, capacity_factor: float,
                              expert_chunks: int = DEFAULT_EXPERT_CHUNKS):
    """The `ragged_capacity` transport's drop rule, one assignment at a time, on a (data, ep) mesh
    whose devices each hold T / (data * ep) consecutive tokens. Returns (kept bool [T, k], sender
    drops (always 0: a sender sends what the receiver will hold), receiver drops).

    Per receiving device and chunk of its local experts, one buffer of `chunk_capacity` rows is
    filled expert by expert (in local expert order), and within an expert source device by source
    device, each source's assignments in (token, slot) order; those past the buffer's end are dropped."""
    ids = np.asarray(expert_ids)
    t_all, k = ids.shape
    t_loc = t_all // (data * ep)
    e_loc = n_experts // ep
    per_chunk = check_expert_chunks(n_experts, ep, expert_chunks)
    cap = chunk_capacity(t_loc, k, n_experts, ep, capacity_factor, expert_chunks)
    kept = np.zeros(ids.shape, bool)
    recv_drops = 0
    for g in range(data):
        arrived = {}  # global expert -> {source: [assignments in send order]}
        for s in range(ep):
            shard = g * ep + s
            for t in range(shard * t_loc, (shard + 1) * t_loc):
                for j in range(k):
                    arrived.setdefault(int(ids[t, j]), {}).setdefault(s, []).append((t, j))
        for dest in range(ep):
            for c in range(expert_chunks):
                order = []
                for e in range(c * per_chunk, (c + 1) * per_chunk):
                    by_src = arrived.get(dest * e_loc + e, {})
                    for s in range(ep):
                        order.extend(by_src.get(s, []))
                recv_drops += max(0, len(order) - cap)
                for t, j in order[:cap]:
                    kept[t, j] = True
    return kept, 0, recv_drops
