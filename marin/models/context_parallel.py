"""Context parallelism: one sequence split over C devices, so a 262K-token row fits.

Each sequence of a batch is cut into 2C equal chunks and device c of a context-parallel group holds
chunks c and 2C-1-c (the "zig-zag" order of Megatron-Core and Llama 3's context parallelism):
under a causal mask the late chunks see more keys than the early ones, and pairing an early chunk
with a late one gives every device the same attention work (contiguous shards would leave the last
device with (2C-1)/C of the mean: 1.75x at C = 4). The C devices of a group are C consecutive
devices of the "expert" axis (one rack in the hero's mesh: NVLink), so the mesh, the parameters and
their sharding are unchanged; only the token layout changes:

    tokens [B, L]  ->  rows [B x C, L / C]      row (group g, shard c, sequence t) on device g*C + c

Everything but attention is per token (embeddings, norms, the MoE block: a shard's tokens route
like any other tokens, the loss: a mean over the same tokens), so it runs on the rows unchanged;
RoPE takes each token's position in its sequence. Attention, per layer kind:

  local (sliding-window) layers   a halo exchange: each chunk needs only the last ``window - 1``
                                  keys and values of the chunk before it (one ppermute forward for
                                  the first chunks, one backward for the second: chunk 2C-1-c
                                  follows chunk 2C-2-c, the second chunk of device c+1)
  global layers                   an all-gather of K and V over the group (C - 1 ring steps of
                                  ppermute), then each chunk against every key before it

Why the all-gather and not ring attention for the global layers, from the planner's numbers for
the hero at 262,144 tokens and C = 4 (docs/model.md): the gathered K and V of one global layer
are 2 x 262,144 x 6 heads x 128 x 2 bytes = 0.75 GiB per sequence (plus 1.5 GiB of float32 dK,
dV in the backward) against ~170 GiB usable, and receiving them over NVLink takes about a
millisecond against about 0.2 s of attention compute per global layer on the device, so the
ring's overlap of communication with compute would save under 1% while it needs its own backward
(dK and dV travelling the ring the other way). The gradient of the gather is the transpose of
the ppermutes (JAX derives it), the attention kernel is the same blocked kernel with its custom
backward (``blocked_attention_at``).

Both paths compute exactly what single-device blocked attention computes on the whole sequence,
up to float summation order (tests/models/test_context_parallel.py, forward and gradients).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from marin.models.blocked_attention import blocked_attention_at, expand_kv_heads
from marin.parallel.mesh import EXPERT, TOKEN_AXES

NO_DOCUMENT = jnp.iinfo(jnp.int32).min  # the segment id of halo keys that do not exist (before the first chunk)


class ContextParallelError(ValueError):
    """A batch or mesh that cannot be split into context-parallel shards (one-line message)."""


def chunk_order(degree: int) -> list[int]:
    """The sequence's 2C chunks in row order: shard c holds chunks c and 2C-1-c."""
    return [j for c in range(degree) for j in (c, 2 * degree - 1 - c)]


def check_split(batch: int, seq_len: int, degree: int, mesh) -> None:
    """Raise ContextParallelError unless ``batch`` sequences of ``seq_len`` split into rows of
    ``degree`` shards over ``mesh``: C divides the expert axis, 2C divides the length, and the B x C
    rows divide evenly over the devices."""
    n, expert = mesh.size, mesh.shape[EXPERT]
    if degree < 1 or expert % degree:
        raise ContextParallelError(f"context parallelism {degree} must divide the expert axis ({expert} devices)")
    if seq_len % (2 * degree):
        raise ContextParallelError(f"sequence length {seq_len} is not a multiple of 2 x context parallelism "
                                   f"{degree} (each device holds two equal chunks)")
    if (batch * degree) % n:
        raise ContextParallelError(f"{batch} sequences x {degree} shards do not split over {n} devices")


def to_shards(x, degree: int, n_devices: int):
    """[B, L, ...] -> rows [B x C, L / C, ...] in the context-parallel layout (module docstring)."""
    b, length = x.shape[:2]
    rest = x.shape[2:]
    groups = n_devices // degree
    per = b // groups  # sequences per group = rows per device
    lc = length // (2 * degree)
    x = x.reshape(groups, per, 2 * degree, lc, *rest)
    x = jnp.take(x, jnp.array(chunk_order(degree)), axis=2)
    x = x.reshape(groups, per, degree, 2 * lc, *rest)
    x = jnp.swapaxes(x, 1, 2)  # [groups, C, per, 2 lc, ...]
    return x.reshape(b * degree, 2 * lc, *rest)


def from_shards(x, degree: int, n_devices: int):
    """The inverse of :func:`to_shards`: rows [B x C, L / C, ...] -> [B, L, ...]."""
    rows, two_lc = x.shape[:2]
    rest = x.shape[2:]
    groups = n_devices // degree
    b = rows // degree
    per = b // groups
    lc = two_lc // 2
    x = jnp.swapaxes(x.reshape(groups, degree, per, 2 * lc, *rest), 1, 2)  # [groups, per, C, 2 lc, ...]
    x = x.reshape(groups, per, 2 * degree, lc, *rest)
    inverse = [chunk_order(degree).index(j) for j in range(2 * degree)]
    x = jnp.take(x, jnp.array(inverse), axis=2)
    return x.reshape(b, 2 * degree * lc, *rest)


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """How a forward splits its sequences: ``degree`` shards per sequence over groups of ``degree``
    consecutive devices of ``mesh``'s expert axis; ``block`` the attention kernel's block."""

    mesh: object
    degree: int
    block: int

    def rows(self, x):
        """[B, L, ...] -> context-parallel rows, split over the mesh's token axes."""
        out = to_shards(x, self.degree, self.mesh.size)
        spec = P(TOKEN_AXES, *([None] * (out.ndim - 1)))
        return jax.lax.with_sharding_constraint(out, NamedSharding(self.mesh, spec))

    def positions(self, batch: int, seq_len: int):
        """Each row's token positions in its sequence [B x C, L / C] (for RoPE)."""
        pos = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
        return self.rows(pos)

    def attention(self, q, k, v, window, segment_ids, cfg):
        """q [R, Lr, S, g, hd], k, v [R, Lr, S, hd] (S = stored KV heads) in the row layout ->
        [R, Lr, S, g, hd]: each row's queries against every key of its sequence they may see."""
        seg = jnp.zeros(q.shape[:2], jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
        tok = P(TOKEN_AXES)
        body = functools.partial(_shard_attention, degree=self.degree, block=self.block,
                                 expert=self.mesh.shape[EXPERT], cfg=cfg)
        f = jax.shard_map(body, mesh=self.mesh, in_specs=(tok, tok, tok, tok, P()), out_specs=tok,
                          check_vma=False)
        return f(q, k, v, seg, jnp.asarray(window, jnp.int32))


def _group_perm(expert: int, degree: int, shift: int, ring: bool) -> list[tuple[int, int]]:
    """ppermute pairs on the expert axis moving data ``shift`` shards along each group (``ring``:
    wrapping around; else the ends send / receive nothing)."""
    pairs = []
    for g in range(expert // degree):
        for i in range(degree):
            j = i + shift
            if ring:
                j %= degree
            elif not 0 <= j < degree:
                continue
            pairs.append((g * degree + i, g * degree + j))
    return pairs


def _gather_sequence(x, c, degree: int, expert: int):
    """This device's two chunks x [r, 2 lc, ...] -> the whole sequence [r, 2C lc, ...] of its group,
    in sequence order: an all-gather over the group as C - 1 ring steps."""
    parts, cur = [x], x
    for _ in range(1, degree):
        cur = jax.lax.ppermute(cur, EXPERT, _group_perm(expert, degree, 1, ring=True))
        parts.append(cur)  # parts[h]: the chunks of shard (c - h) mod C
    by_shard = jnp.take(jnp.stack(parts), (c - jnp.arange(degree)) % degree, axis=0)  # [C, r, 2 lc, ...]
    lc = x.shape[1] // 2
    chunks = jnp.concatenate([by_shard[:, :, :lc], by_shard[::-1, :, lc:]], axis=0)  # [2C, r, lc, ...] in order
    return jnp.moveaxis(chunks, 0, 1).reshape(x.shape[0], 2 * degree * lc, *x.shape[2:])


def _shard_attention(q, k, v, seg, window, *, degree: int, block: int, expert: int, cfg):
    """One device's rows: q [r, 2 lc, S, g, hd], k, v [r, 2 lc, S, hd], seg [r, 2 lc]."""
    c = jax.lax.axis_index(EXPERT) % degree
    lc = q.shape[1] // 2
    first, second = c, 2 * degree - 1 - c  # this device's chunks
    halo = cfg.sliding_window - 1

    def per_chunk(keys, values, seg_k, offsets):
        out = []
        for a, offset in enumerate(offsets):
            qa, sa = q[:, a * lc:(a + 1) * lc], seg[:, a * lc:(a + 1) * lc]
            kk, vv, ss = keys[a], values[a], seg_k[a]
            out.append(blocked_attention_at(qa, kk, vv, window, sa, ss, offset, block=block))
        return jnp.concatenate(out, axis=1)

    def gathered(used: int):
        kk = _gather_sequence(k[..., :used, :], c, degree, expert)  # [r, L, used, hd]
        vv = _gather_sequence(v[..., :used, :], c, degree, expert)
        ss = _gather_sequence(seg, c, degree, expert)  # [r, L]
        kk, vv = expand_kv_heads(kk, used, k.shape[-2]), expand_kv_heads(vv, used, k.shape[-2])
        return per_chunk((kk, kk), (vv, vv), (ss, ss), (first * lc, second * lc))

    def with_halo(used: int):
        ku, vu = k[..., :used, :], v[..., :used, :]

        def tails(x):  # the last `halo` positions of each of the two chunks
            return x[:, lc - halo:lc], x[:, 2 * lc - halo:]

        (k1, k2), (v1, v2), (s1, s2) = tails(ku), tails(vu), tails(seg)
        fwd = functools.partial(jax.lax.ppermute, axis_name=EXPERT, perm=_group_perm(expert, degree, 1, ring=False))
        bwd = functools.partial(jax.lax.ppermute, axis_name=EXPERT, perm=_group_perm(expert, degree, -1, ring=False))
        # the first chunk's halo: the previous shard's first chunk (none before chunk 0)
        hk1, hv1, hs1 = fwd(k1), fwd(v1), jnp.where(c > 0, fwd(s1), NO_DOCUMENT)
        # the second chunk's halo: the next shard's second chunk, or on the last shard its own first chunk
        last = c == degree - 1
        hk2, hv2, hs2 = (jnp.where(last, k1, bwd(k2)), jnp.where(last, v1, bwd(v2)),
                         jnp.where(last, s1, bwd(s2)))
        keys = [jnp.concatenate([h, ku[:, a * lc:(a + 1) * lc]], axis=1) for a, h in enumerate((hk1, hk2))]
        values = [jnp.concatenate([h, vu[:, a * lc:(a + 1) * lc]], axis=1) for a, h in enumerate((hv1, hv2))]
        segs = [jnp.concatenate([h, seg[:, a * lc:(a + 1) * lc]], axis=1) for a, h in enumerate((hs1, hs2))]
        stored = k.shape[-2]
        keys = [expand_kv_heads(x, used, stored) for x in keys]
        values = [expand_kv_heads(x, used, stored) for x in values]
        return per_chunk(keys, values, segs, (halo, halo))

    local = functools.partial(with_halo if 1 <= halo <= lc else gathered, cfg.n_kv_heads)
    is_global = window > cfg.sliding_window
    return jax.lax.cond(is_global, lambda: gathered(cfg.kv_heads_global), local)


def sequence_attention(q, k, v, window, segment_ids, cfg, mesh, degree: int):
    """Attention of whole sequences computed context-parallel: q [B, L, S, g, hd], k, v [B, L, S, hd],
    segment_ids [B, L] or None -> [B, L, S, g, hd], what single-device blocked attention gives. A
    length 2C does not divide is padded at the end (causality hides the padded keys from every real
    query; the padded queries are dropped)."""
    b, length = q.shape[:2]
    pad = (-length) % (2 * degree)
    seg = jnp.zeros((b, length), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    if pad:
        def pad_seq(x):
            return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))

        q, k, v, seg = pad_seq(q), pad_seq(k), pad_seq(v), pad_seq(seg)
    check_split(b, length + pad, degree, mesh)
    context = ContextParallel(mesh, degree, cfg.attention_block)
    o = context.attention(context.rows(q), context.rows(k), context.rows(v), window, context.rows(seg), cfg)
    return from_shards(o, degree, mesh.size)[:, :length]
