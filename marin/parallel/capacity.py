"""The expert-parallel transports' names and their buffer sizes: pure integer arithmetic, no JAX.

One formula per number: the transports (:mod:`marin.parallel.transports`) allocate exactly these
buffers, the dense reference (:mod:`marin.models.reference`) drops exactly as they do, and the
memory planner (:mod:`marin.training.planning`) counts exactly these rows, all by calling here.

A fixed-capacity transport sizes each buffer at the expected count of one wave times the capacity
factor (the published run used 1.15), capped at the worst case: a sender puts at most
``ceil(cf * t * k / ep)`` of its ``t * k`` assignments in the slot block of each destination device,
and a receiver keeps at most ``ceil(cf * ep * t * k / n_experts)`` rows per local expert; what
overflows is dropped (and counted on both sides). The dropless transports size for the worst case.

The capacity-bounded ragged transport (``ragged_capacity``) pools the receiver's capacity over a
chunk of its local experts instead of giving each expert its own: a receiving device runs its
``e_loc`` local experts in ``expert_chunks`` chunks one after the other, and each chunk has one
buffer of ``ceil(cf * expected assignments of the chunk)`` rows, the expected count being
``ep * t * k * (e_loc / expert_chunks) / n_experts``. A device's total load over a chunk varies far
less than one expert's load, so the same factor drops far fewer assignments; senders send exactly
the rows the receivers will hold, so there is no send-side buffer to overflow.
"""

from __future__ import annotations

import math

TRANSPORTS = ("local", "fixed", "dropless", "ragged", "ragged_capacity")
"""How routed tokens reach their experts: ``local`` (no expert parallelism) and the EP transports."""
EP_TRANSPORTS = tuple(t for t in TRANSPORTS if t != "local")
"""The transports that move tokens between devices."""
DROPPING_TRANSPORTS = ("fixed", "ragged_capacity")
"""The transports whose buffers are bounded by the capacity factor and may drop assignments; the
others (``local``, ``dropless``, ``ragged``) never drop, at worst-case memory for the EP ones."""
DEFAULT_EXPERT_CHUNKS = 2
"""Chunks of local experts a ``ragged_capacity`` receiver runs one after the other (the published run: 2)."""


def send_capacity(tokens_per_shard: int, top_k: int, n_experts: int, ep: int, capacity_factor: float | None) -> int:
    """Slots per destination device in a sender's buffer. None = worst case (dropless)."""
    worst = tokens_per_shard * min(top_k, n_experts // ep)
    if capacity_factor is None:
        return worst
    return min(worst, math.ceil(capacity_factor * tokens_per_shard * top_k / ep))


def recv_capacity(tokens_per_shard: int, top_k: int, n_experts: int, ep: int, capacity_factor: float | None) -> int:
    """Slots per local expert in a receiver's buffer: cf x the expected per-expert count of a wave."""
    worst = ep * tokens_per_shard
    if capacity_factor is None:
        return worst
    return min(worst, math.ceil(capacity_factor * ep * tokens_per_shard * top_k / n_experts))


def check_expert_chunks(n_experts: int, ep: int, expert_chunks: int) -> int:
    """Local experts per chunk; a clear error when the chunks do not split a device's experts evenly."""
    e_loc = n_experts // ep
    if not isinstance(expert_chunks, int) or expert_chunks < 1 or e_loc % expert_chunks:
        raise ValueError(f"expert_chunks={expert_chunks!r} must be a positive int dividing the {e_loc} local experts "
                         f"of a device ({n_experts} experts over expert parallelism {ep})")
    return e_loc // expert_chunks


def chunk_capacity(tokens_per_shard: int, top_k: int, n_experts: int, ep: int, capacity_factor: float | None,
                   expert_chunks: int = DEFAULT_EXPERT_CHUNKS) -> int:
    """Rows of a ``ragged_capacity`` receiver's buffer for one chunk of its local experts: cf x the
    expected assignments of the chunk (``ep * t * k * experts_per_chunk / n_experts``), capped at the
    worst case (every source sends each token to ``min(k, experts_per_chunk)`` of the chunk's
    experts). None = the worst case."""
    per_chunk = check_expert_chunks(n_experts, ep, expert_chunks)
    worst = ep * tokens_per_shard * min(top_k, per_chunk)
    if capacity_factor is None:
        return worst
    return min(worst, math.ceil(capacity_factor * ep * tokens_per_shard * top_k * per_chunk / n_experts))


def buffer_rows_per_token(transport: str, tokens_per_shard: int, top_k: int, n_experts: int, ep: int,
                          capacity_factor: float, expert_chunks: int = DEFAULT_EXPERT_CHUNKS) -> dict[str, float]:
    """Rows per local token in the EP buffers: ``send`` (the dispatch buffer, and the combine buffer
    that mirrors it), ``compute`` (the rows the experts multiply, every chunk's: the backward keeps
    them all) and ``buffers`` (the send, receive and return buffers of one layer together): what a
    step's memory holds."""
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}; choose from {TRANSPORTS}")
    if transport == "local":
        return {"send": 0.0, "compute": float(top_k), "buffers": 0.0}
    t = max(1, tokens_per_shard)
    if transport == "ragged_capacity":  # exactly the t * k assignments out and back; one chunk's buffer live
        chunk = chunk_capacity(t, top_k, n_experts, ep, capacity_factor, expert_chunks) / t
        return {"send": float(top_k), "compute": expert_chunks * chunk, "buffers": 2.0 * top_k + chunk}
    cf = capacity_factor if transport == "fixed" else None
    send = ep * send_capacity(t, top_k, n_experts, ep, cf) / t
    if transport != "fixed":  # dropless / ragged: the experts compute over the whole worst-case buffer
        return {"send": send, "compute": send, "buffers": 3 * send}
    return {"send": send, "compute": (n_experts // ep) * recv_capacity(t, top_k, n_experts, ep, cf) / t,
            "buffers": 3 * send}



def emulated_ragged_rows_per_token(transport: str, tokens_per_shard: int, top_k: int, n_experts: int, ep: int,
                                   capacity_factor: float, expert_chunks: int = DEFAULT_EXPERT_CHUNKS) -> float:
    """Rows per local token of the blocks the CPU emulation of ``ragged_all_to_all`` holds while one
    call runs (XLA:CPU lacks the op; marin.parallel.transports.ragged_all_to_all_emulated): the
    operand spread over ``ep`` worst-case blocks, and those blocks once received. 0 for the
    transports that do not use it; GPU programs call the real op and hold none of this."""
    if transport not in ("ragged", "ragged_capacity"):
        return 0.0
    t = max(1, tokens_per_shard)
    if transport == "ragged":
        back = ep * t * min(top_k, n_experts // ep)  # the return trip's operand: the worst-case receive buffer
    else:
        back = chunk_capacity(t, top_k, n_experts, ep, capacity_factor, expert_chunks)
    return 2.0 * ep * max(t * top_k, back) / t
