"""Router: sigmoid scores, bias-steered top-k selection, and the bias updates that balance experts.

The per-expert bias only changes WHICH experts a token selects; the combine weights come from the
unbiased scores. The bias gets no gradient: it is recomputed between steps from statistics
(quantile balancing) or nudged by the sign of the load error (sign step). It lives in the training
state, not in the parameters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def route(z, w_router, bias, top_k: int, normalize: bool = True):
    """z [T, D] -> (expert_ids int32 [T, k], combine weights f32 [T, k], scores f32 [T, E])."""
    logits = jnp.dot(z, w_router.astype(z.dtype), preferred_element_type=jnp.float32)  # [T, E] f32
    scores = jax.nn.sigmoid(logits)  # [T, E] in (0, 1)
    biased = jax.lax.stop_gradient(scores + jax.lax.stop_gradient(bias)[None, :])  # [T, E]
    _, expert_ids = jax.lax.top_k(biased, top_k)  # [T, k]
    weights = jnp.take_along_axis(scores, expert_ids, axis=-1)  # [T, k], from the unbiased scores
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return expert_ids.astype(jnp.int32), weights, scores


def expert_load(expert_ids, n_experts: int):
    """Number of assignments per expert (float32 [E])."""
    return jnp.zeros((n_experts,), jnp.float32).at[expert_ids.reshape(-1)].add(1.0)


def selection_margins(scores, bias, top_k: int):
    """u[t, e] = scores[t, e] - (the biased score expert e must beat to be in token t's top-k).

    Token t selects e iff scores[t, e] + bias[e] > thr[t, e], where thr is the k-th largest biased
    score among the OTHER experts: the (k+1)-th overall if e is currently selected, else the k-th.
    So with bias b_e, expert e gets #{t : u[t, e] > -b_e} tokens (other biases held fixed)."""
    biased = scores + bias[None, :]  # [T, E]
    n_experts = scores.shape[-1]
    kk = min(top_k + 1, n_experts)
    top_vals, _ = jax.lax.top_k(biased, kk)  # [T, k + 1] (or [T, E] when k = E)
    kth = top_vals[:, top_k - 1 : top_k]  # [T, 1]
    kth1 = top_vals[:, kk - 1 : kk] if kk > top_k else jnp.full_like(kth, -jnp.inf)
    selected = biased >= kth  # [T, E]
    thr = jnp.where(selected, kth1, kth)  # [T, E]
    return scores - thr


def quantile_bias_target(scores, bias, top_k: int, n_bins: int = 1024):
    """The mean-centred bias that would give every expert exactly T*k/E tokens, estimated per expert
    from a histogram of the selection margins u (so it is a global sum when T is sharded).

    b_e = -q_e where q_e is the value with T*k/E margins above it (linear within the crossing bin)."""
    hist = margin_histogram(scores, bias, top_k, n_bins)
    return bias_target_from_histogram(hist, bias, scores.shape[0], top_k)


def _margin_range(bias):
    # u is in (-1 - max b, 1 - min b) since scores are in (0, 1)
    bias = jax.lax.stop_gradient(bias).astype(jnp.float32)
    return -1.0 - jnp.max(bias) - 1e-6, 1.0 - jnp.min(bias) + 1e-6


def margin_histogram(scores, bias, top_k: int, n_bins: int = 1024):
    """float32 [E, n_bins]: per expert, how many selection margins fall in each bin of a range fixed
    by the bias alone. Additive over tokens: the histograms of several microbatches (same params and
    bias) sum to the histogram of their union."""
    scores = jax.lax.stop_gradient(scores).astype(jnp.float32)
    bias = jax.lax.stop_gradient(bias).astype(jnp.float32)
    n_experts = scores.shape[1]
    u = selection_margins(scores, bias, top_k)  # [T, E]
    lo, hi = _margin_range(bias)
    width = (hi - lo) / n_bins
    bins = jnp.clip(jnp.floor((u - lo) / width).astype(jnp.int32), 0, n_bins - 1)  # [T, E]
    flat = bins + jnp.arange(n_experts, dtype=jnp.int32)[None, :] * n_bins  # [T, E] into [E * n_bins]
    hist = jnp.zeros((n_experts * n_bins,), jnp.float32).at[flat.reshape(-1)].add(1.0)
    return hist.reshape(n_experts, n_bins)


def bias_target_from_histogram(hist, bias, n_tokens, top_k: int):
    """The balancing bias target from a margin histogram over ``n_tokens`` tokens."""
    n_experts, n_bins = hist.shape
    lo, hi = _margin_range(bias)
    width = (hi - lo) / n_bins
    # above[e, j] = number of margins in bins >= j  (i.e. u >= lo + j*width)
    above = jnp.cumsum(hist[:, ::-1], axis=1)[:, ::-1]  # [E, n_bins]
    target = n_tokens * top_k / n_experts
    # j* = the last bin whose lower edge still has >= target margins above it
    j = jnp.sum(above >= target, axis=1) - 1
    j = jnp.clip(j, 0, n_bins - 1)  # [E]
    above_j = jnp.take_along_axis(above, j[:, None], axis=1)[:, 0]
    in_bin = jnp.take_along_axis(hist, j[:, None], axis=1)[:, 0]
    above_next = above_j - in_bin
    frac = jnp.where(in_bin > 0, (target - above_next) / jnp.maximum(in_bin, 1.0), 0.0)
    q = lo + (j + 1).astype(jnp.float32) * width - frac * width  # [E]
    b = -q
    return b - jnp.mean(b)


def quantile_bias_target_exact(scores, bias, top_k: int):
    """Slow obvious reference (sorts every expert's margins; not shardable)."""
    u = selection_margins(scores, bias, top_k)  # [T, E]
    n_tokens, n_experts = scores.shape
    target = n_tokens * top_k / n_experts
    s = -jnp.sort(-u, axis=0)  # descending per expert
    c = int(round(target))
    upper = s[c - 1]
    lower = s[c] if c < n_tokens else s[c - 1] - 1.0
    b = -(upper + lower) / 2
    return b - jnp.mean(b)


def quantile_update(bias, bias_target, rate: float = 1.0):
    """Move the bias `rate` of the way to the balancing target (1.0 = jump there)."""
    return bias + rate * (bias_target - bias)


def sign_update(bias, load, rate: float = 1e-3):
    """bias += gamma * sign(mean load - load): under-loaded experts get more attractive."""
    load = load.astype(jnp.float32)
    return bias + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
