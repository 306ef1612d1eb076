"""The expert-parallel transports' names and their buffer sizes: pure integer arithmetic, no JAX.

One formula per number: the transports (:mod:`marin.parallel.transports`) allocate exactly these
buffers, the dense reference (:mod:`marin.models.reference`) drops exactly as they do, and the
memory planner (:mod:`marin.training.planning`) counts exactly these rows, all by calling here.

A fixed-capacity transport sizes each buffer at the expected count of one wave times the capacity
factor (the published run used 1.15), capped at the worst case: a sender puts at most
``ceil(cf * t * k / ep)`` of its ``t * k`` assignments in the slot block of each destination device,
and a receiver keeps at most ``ceil(cf * ep * t * k / n_experts)`` rows per local expert; what
overflows is dropped (and counted on both sides). The dropless transports size for the worst case.
"""

from __future__ import annotations

import math

TRANSPORTS = ("local", "fixed", "dropless", "ragged")
"""How routed tokens reach their experts: ``local`` (no expert parallelism) and the EP transports."""
EP_TRANSPORTS = tuple(t for t in TRANSPORTS if t != "local")
"""The transports that move tokens between devices."""


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


def buffer_rows_per_token(transport: str, tokens_per_shard: int, top_k: int, n_experts: int, ep: int,
                          capacity_factor: float) -> dict[str, float]:
    """Rows per local token in the EP buffers: ``send`` (the dispatch buffer, and the combine buffer
    that mirrors it) and ``compute`` (the rows the experts multiply): what a step's memory holds."""
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}; choose from {TRANSPORTS}")
    if transport == "local":
        return {"send": 0.0, "compute": float(top_k)}
    t = max(1, tokens_per_shard)
    cf = capacity_factor if transport == "fixed" else None
    send = ep * send_capacity(t, top_k, n_experts, ep, cf) / t
    if transport != "fixed":  # dropless / ragged: the experts compute over the whole worst-case buffer
        return {"send": send, "compute": send}
    return {"send": send, "compute": (n_experts // ep) * recv_capacity(t, top_k, n_experts, ep, cf) / t}
