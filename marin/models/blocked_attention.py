"""Blocked ("flash-style") attention: the same function as the dense attention without its [L, L] scores.

The sequence is cut into blocks of ``block`` positions. For each query block a loop visits only the
key blocks it can see and keeps an online softmax in float32: the running row maximum ``m``, the
normaliser ``l = sum exp(s - m)`` and the unnormalised output ``acc = sum exp(s - m) v``; a new key
block rescales them by ``exp(m_old - m_new)``. The result is ``acc / l``: in float32 the dense
softmax up to summation order; in bf16 the probabilities are rounded before normalising (dense
rounds them after), which keeps the normalisation in float32.

Which key blocks a query block ``i`` visits: from the block holding the first key its first query
may see (``i * block - window + 1``, the sliding window) to ``i`` itself (causal). Both bounds are
computed from the (traced) window of the layer, so local layers of a 262K sequence visit about
``window / block + 1`` key blocks per query block and global layers the causal half; the bounds make
the loop a ``while`` with a dynamic trip count. Inside a visited tile the exact mask (causal, window,
same document) is applied elementwise; tiles that are masked only by document boundaries are not
skipped (the documents of a packed row are data, not known when the program is built).

Gradients come from a custom VJP (the FlashAttention-2 backward): the forward saves only q, k, v,
the output and the per-row log-normaliser ``lse`` (O(L)); the backward revisits the same tiles,
recomputes ``p = exp(s - lse)`` and accumulates dq per query block and dk, dv into float32
sequence-length buffers. Nothing of size L x L is ever live, forward or backward.

A sequence length that ``block`` does not divide is padded at the end. Causality makes the padded
keys invisible to every real query, and the padded queries' outputs are dropped, so padding changes
nothing: the evaluator's windows of any length can use this path.

:func:`blocked_attention_at` is the same kernel for queries that are a later stretch of the keys'
sequence (query i at key position ``q_offset + i``): one shard of a context-parallel sequence
against its halo or against the gathered keys of every shard (:mod:`marin.models.context_parallel`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

NEG = -1e30  # "minus infinity" of a masked score; finite, so fully masked tiles never produce NaN


def visible_key_blocks(i, block: int, window, q_offset=0, n_key_blocks=None):
    """(first, last) key block a query block ``i`` can see under causality and a sliding window
    (queries start at key position ``q_offset``)."""
    first_key = jnp.maximum(q_offset + i * block - window + 1, 0)
    last = (q_offset + (i + 1) * block - 1) // block
    if n_key_blocks is not None:
        last = jnp.minimum(last, n_key_blocks - 1)
    return first_key // block, last


def expand_kv_heads(k, used: int, stored: int):
    """k [..., >= used, hd] -> its first ``used`` KV heads, each repeated stored / used times: with
    ``stored`` KV slots of h / stored query heads each, query head i then reads KV head
    i // (h / used), the grouped-query layout of a layer with ``used`` KV heads."""
    k = k[..., :used, :]
    return k if used == stored else jnp.repeat(k, stored // used, axis=-2)


def _tile(x, start, block):
    return jax.lax.dynamic_slice_in_dim(x, start, block, axis=1)


def _tile_mask(q_start, k_start, block, window, seg_q, seg_k):  # q_start: the query tile's key position
    """[B, 1, 1, bq, bk] bool: key j visible from query i iff j <= i, i - j < window, same document."""
    qpos = q_start + jnp.arange(block)[:, None]
    kpos = k_start + jnp.arange(block)[None, :]
    mask = (kpos <= qpos) & (qpos - kpos < window)
    mask = mask[None] & (seg_q[:, :, None] == seg_k[:, None, :])
    return mask[:, None, None]


def _scores(qi, kj, hd):
    return jnp.einsum("bqkgh,bskh->bkgqs", qi, kj, preferred_element_type=jnp.float32) / math.sqrt(hd)


def _forward(q, k, v, seg, seg_k, window, q_offset, block):
    b, length, kv, g, hd = q.shape
    n, n_k = length // block, k.shape[1] // block

    def query_block(_, i):
        q_start = i * block
        qi, seg_q = _tile(q, q_start, block), _tile(seg, q_start, block)  # [B, bq, kv, g, hd], [B, bq]

        def key_block(j, carry):
            m, l, acc = carry
            k_start = j * block
            mask = _tile_mask(q_offset + q_start, k_start, block, window, seg_q, _tile(seg_k, k_start, block))
            s = jnp.where(mask, _scores(qi, _tile(k, k_start, block), hd), NEG)  # [B, kv, g, bq, bk] f32
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))  # [B, kv, g, bq]
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)  # [B, kv, g, bq, bk]
            corr = jnp.exp(m - m_new)  # [B, kv, g, bq]
            # pv [B, kv, g, bq, hd] f32
            pv = jnp.einsum("bkgqs,bskh->bkgqh", p.astype(v.dtype), _tile(v, k_start, block),
                            preferred_element_type=jnp.float32)
            return m_new, l * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + pv

        init = (jnp.full((b, kv, g, block), NEG, jnp.float32), jnp.zeros((b, kv, g, block), jnp.float32),
                jnp.zeros((b, kv, g, block, hd), jnp.float32))
        first, last = visible_key_blocks(i, block, window, q_offset, n_k)
        m, l, acc = jax.lax.fori_loop(first, last + 1, key_block, init)
        l = jnp.where(l > 0, l, 1.0)  # a (padding) query that sees no key: output 0, not 0 / 0
        return None, ((acc / l[..., None]).astype(q.dtype), m + jnp.log(l))

    _, (o, lse) = jax.lax.scan(query_block, None, jnp.arange(n))
    # o [n, b, kv, g, block, hd] -> [b, L, kv, g, hd]; lse [n, b, kv, g, block] -> [b, kv, g, L]
    o = o.transpose(1, 0, 4, 2, 3, 5).reshape(b, length, kv, g, hd)
    lse = lse.transpose(1, 2, 3, 0, 4).reshape(b, kv, g, length)
    return o, lse


def _backward(q, k, v, seg, seg_k, window, q_offset, block, o, lse, do):
    b, length, kv, g, hd = q.shape
    n, n_k = length // block, k.shape[1] // block
    # delta [B, kv, g, L]: rowsum(dO * O)
    delta = jnp.einsum("bqkgh,bqkgh->bkgq", do.astype(jnp.float32), o.astype(jnp.float32))

    def query_block(carry, i):
        dk, dv = carry
        q_start = i * block
        # qi, doi [B, bq, kv, g, hd], seg_q [B, bq]
        qi, doi, seg_q = _tile(q, q_start, block), _tile(do, q_start, block), _tile(seg, q_start, block)
        lse_i = jax.lax.dynamic_slice_in_dim(lse, q_start, block, axis=3)  # [B, kv, g, bq]
        delta_i = jax.lax.dynamic_slice_in_dim(delta, q_start, block, axis=3)

        def key_block(j, carry):
            dq_i, dk, dv = carry
            k_start = j * block
            kj, vj = _tile(k, k_start, block), _tile(v, k_start, block)  # [B, bk, kv, hd]
            mask = _tile_mask(q_offset + q_start, k_start, block, window, seg_q, _tile(seg_k, k_start, block))
            p = jnp.where(mask, jnp.exp(_scores(qi, kj, hd) - lse_i[..., None]), 0.0)  # [B, kv, g, bq, bk]
            # dv_j [B, bk, kv, hd]
            dv_j = jnp.einsum("bkgqs,bqkgh->bskh", p.astype(do.dtype), doi, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bqkgh,bskh->bkgqs", doi, vj, preferred_element_type=jnp.float32)  # [B, kv, g, bq, bk]
            ds = p * (dp - delta_i[..., None]) / math.sqrt(hd)  # [B, kv, g, bq, bk]
            dq_i = dq_i + jnp.einsum("bkgqs,bskh->bqkgh", ds.astype(k.dtype), kj, preferred_element_type=jnp.float32)
            # dk_j [B, bk, kv, hd]
            dk_j = jnp.einsum("bkgqs,bqkgh->bskh", ds.astype(q.dtype), qi, preferred_element_type=jnp.float32)
            dk = jax.lax.dynamic_update_slice_in_dim(dk, _tile(dk, k_start, block) + dk_j, k_start, axis=1)
            dv = jax.lax.dynamic_update_slice_in_dim(dv, _tile(dv, k_start, block) + dv_j, k_start, axis=1)
            return dq_i, dk, dv

        first, last = visible_key_blocks(i, block, window, q_offset, n_k)
        dq_i = jnp.zeros((b, block, kv, g, hd), jnp.float32)  # [B, bq, kv, g, hd]
        dq_i, dk, dv = jax.lax.fori_loop(first, last + 1, key_block, (dq_i, dk, dv))
        return (dk, dv), dq_i.astype(q.dtype)

    zeros_kv = jnp.zeros((b, k.shape[1], kv, hd), jnp.float32)  # [B, Lk, kv, hd]: dk, dv accumulate here
    (dk, dv), dq = jax.lax.scan(query_block, (zeros_kv, zeros_kv), jnp.arange(n))
    dq = dq.transpose(1, 0, 2, 3, 4, 5).reshape(b, length, kv, g, hd)  # [n, B, bq, kv, g, hd] -> [B, L, kv, g, hd]
    return dq, dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _blocked(q, k, v, seg, seg_k, window, q_offset, block):
    return _forward(q, k, v, seg, seg_k, window, q_offset, block)[0]


def _blocked_fwd(q, k, v, seg, seg_k, window, q_offset, block):
    o, lse = _forward(q, k, v, seg, seg_k, window, q_offset, block)
    return o, (q, k, v, seg, seg_k, window, q_offset, o, lse)


def _blocked_bwd(block, residuals, do):
    q, k, v, seg, seg_k, window, q_offset, o, lse = residuals
    dq, dk, dv = _backward(q, k, v, seg, seg_k, window, q_offset, block, o, lse, do)
    return dq, dk, dv, None, None, None, None  # segment ids, the window and the offset are integers


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


def blocked_attention(q, k, v, window, segment_ids=None, *, block: int):
    """softmax(q k^T / sqrt(hd) + mask) v without materialising the scores.

    q [B, L, kv, g, hd] (g query heads share each of the kv heads), k, v [B, L, kv, hd]; ``window``
    an int (or traced int32 scalar): key j is visible from query i iff j <= i and i - j < window;
    segment_ids [B, L] (optional): and only within the same document. Returns [B, L, kv, g, hd] in
    q's dtype. Sequences shorter than ``block`` use one block of their own length."""
    if block < 1:
        raise ValueError(f"attention block must be >= 1, got {block}")
    b, length = q.shape[:2]
    blk = min(block, length)
    pad = (-length) % blk
    seg = (jnp.zeros((b, length), jnp.int32) if segment_ids is None
           else jnp.broadcast_to(segment_ids.astype(jnp.int32), (b, length)))
    if pad:
        def pad_seq(x):
            return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))

        q, k, v, seg = pad_seq(q), pad_seq(k), pad_seq(v), pad_seq(seg)
    o = _blocked(q, k, v, seg, seg, jnp.asarray(window, jnp.int32), jnp.zeros((), jnp.int32), blk)
    return o[:, :length] if pad else o


def blocked_attention_at(q, k, v, window, seg_q, seg_k, q_offset, *, block: int):
    """:func:`blocked_attention` for queries that sit at key positions ``q_offset .. q_offset + Lq - 1``
    of the keys' sequence: q [B, Lq, kv, g, hd], k, v [B, Lk, kv, hd] with ``q_offset + Lq <= Lk``,
    seg_q [B, Lq] and seg_k [B, Lk] the queries' and keys' documents, ``q_offset`` an int or traced
    int32 scalar. Key j is visible from query i iff j <= q_offset + i, q_offset + i - j < window and
    the documents match. Both lengths are padded to the block: padded keys lie after every query."""
    if block < 1:
        raise ValueError(f"attention block must be >= 1, got {block}")
    b, lq = q.shape[:2]
    lk = k.shape[1]
    blk = min(block, lq)

    def pad_to(x, n):
        return jnp.pad(x, [(0, 0), (0, (-n) % blk)] + [(0, 0)] * (x.ndim - 2)) if n % blk else x

    q, seg_q = pad_to(q, lq), pad_to(seg_q.astype(jnp.int32), lq)
    k, v, seg_k = pad_to(k, lk), pad_to(v, lk), pad_to(seg_k.astype(jnp.int32), lk)
    o = _blocked(q, k, v, seg_q, seg_k, jnp.asarray(window, jnp.int32), jnp.asarray(q_offset, jnp.int32), blk)
    return o[:, :lq]
