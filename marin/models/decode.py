"""Autoregressive decoding with a KV cache, in plain JAX, on the model of :mod:`marin.models.transformer`.

The cache holds each layer's rotated keys and values, so a new token costs one pass through the
layers over ONE position plus attention over what is cached, instead of a forward over the whole
sequence. Its layout follows the attention pattern:

    global layers   [n_global, B, S, kv, hd]     one column per position (S = prompt + new tokens)
    local layers    [n_local,  B, W, kv, hd]     a ring of W = sliding_window slots: column c -> slot c % W

so at long context the 3 of every 4 layers that are sliding-window layers keep only their window
(the hero at 262K context: 12 global layers x 262K columns + 36 local layers x 2,048 slots, about a
quarter of a full-length cache). Each kind holds its own KV-head count: the hero's global layers
cache 6 heads, its local layers 12, so its 262K cache is about an eighth of 12 heads everywhere.
Every slot also records the position of the token it holds
(``-1`` = empty or padding); the attention mask is computed from positions alone:

    key s visible from query t  iff  0 <= pos[s] <= pos[t]  and  pos[t] - pos[s] < window

Prompts of different lengths are left-padded to one width; each row's own tokens start at
position 0 (RoPE positions are per row), so a row decodes exactly as it would alone. Routed experts
run without a capacity limit ("local" on one device, "dropless" across an expert-parallel mesh: a
token's output must not depend on which other prompts share the batch), and the router bias is the
one the run trained with: it steers the top-k selection exactly as in training.

Layers are a Python loop (unrolled when jitted), not a ``lax.scan``: local and global layers carry
caches of different shapes. A step takes T new tokens per row: T = prompt width for the prefill,
T = 1 while generating.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from marin.models.config import MoEConfig
from marin.models.sampling import GREEDY, DecodeError, Sampling, check_prompts  # noqa: F401  (part of this API)
from marin.models.transformer import masked_attention, moe_block, output_logits, rmsnorm, rope
from marin.parallel.mesh import param_shardings, replicated


def decode_transport(cfg: MoEConfig, mesh) -> str:
    """Routed experts without drops: every device's own tokens through every expert on one device,
    the dropless all-to-all on an expert-parallel mesh."""
    return "local" if mesh is None or mesh.size == 1 else "dropless"


def cache_layout(cfg: MoEConfig) -> tuple[list[int], list[int]]:
    """(indices of global layers, indices of local layers), in layer order."""
    windows = cfg.layer_windows()
    return [i for i, w in enumerate(windows) if w is None], [i for i, w in enumerate(windows) if w is not None]


def init_cache(cfg: MoEConfig, batch: int, max_len: int) -> dict:
    """An empty cache for ``batch`` rows of up to ``max_len`` positions (prompt + new tokens)."""
    glob, loc = cache_layout(cfg)
    dt = jnp.dtype(cfg.dtype)
    kv_global, kv_local, hd = cfg.kv_heads_global, cfg.n_kv_heads, cfg.head_dim
    ring = min(cfg.sliding_window, max_len)
    return {
        "global_k": jnp.zeros((len(glob), batch, max_len, kv_global, hd), dt),
        "global_v": jnp.zeros((len(glob), batch, max_len, kv_global, hd), dt),
        "global_pos": jnp.full((batch, max_len), -1, jnp.int32),
        "local_k": jnp.zeros((len(loc), batch, ring, kv_local, hd), dt),
        "local_v": jnp.zeros((len(loc), batch, ring, kv_local, hd), dt),
        "local_pos": jnp.full((batch, ring), -1, jnp.int32),
        "length": jnp.zeros((), jnp.int32),  # columns written so far (the same for every row)
    }


def _visible(query_pos, key_pos, window):
    """[B, Tq, Tk] bool from positions [B, Tq] and [B, Tk] (-1 = empty)."""
    q, k = query_pos[:, :, None], key_pos[:, None, :]
    return (k >= 0) & (q >= 0) & (k <= q) & (q - k < window)


def decode_step(params, router_bias, cache: dict, tokens, positions, cfg: MoEConfig, mesh=None):
    """Feed T new tokens per row: tokens int [B, T], positions int [B, T] (each row's own positions,
    -1 for left padding) -> (logits f32 [B, T, V], the cache with them appended)."""
    dt = jnp.dtype(cfg.dtype)
    transport = decode_transport(cfg, mesh)
    b, t = tokens.shape
    h, hd = cfg.n_heads, cfg.head_dim
    glob, loc = cache_layout(cfg)
    start = cache["length"]
    rope_pos = jnp.maximum(positions, 0)
    ring = cache["local_pos"].shape[1]
    keep = min(t, ring)  # of a chunk longer than the ring only its last `ring` tokens stay cached
    slots = (start + t - keep + jnp.arange(keep)) % ring
    global_pos = jax.lax.dynamic_update_slice(cache["global_pos"], positions.astype(jnp.int32), (0, start))
    local_pos_before = cache["local_pos"]
    new = dict(cache)
    new_k = {"global": [], "local": []}
    new_v = {"global": [], "local": []}

    x = params["embed"].astype(dt)[tokens]  # [B, T, d]
    for i in range(cfg.n_layers):
        p = jax.tree.map(lambda a, i=i: a[i].astype(dt), params["blocks"])
        y = rmsnorm(x, p["attn_norm"], cfg.norm_eps)  # [B, T, d]
        kvh = cfg.kv_heads_of(i)  # this layer's KV heads: the first kvh of the stored projection's
        q = rope((y @ p["wq"]).reshape(b, t, kvh, h // kvh, hd), rope_pos, cfg.rope_theta)  # [B, T, kv, g, hd]
        k = rope((y @ p["wk"][:, :kvh * hd]).reshape(b, t, kvh, hd), rope_pos, cfg.rope_theta)  # [B, T, kv, hd]
        v = (y @ p["wv"][:, :kvh * hd]).reshape(b, t, kvh, hd)  # [B, T, kv, hd]
        if i in glob:
            j = glob.index(i)
            ks = jax.lax.dynamic_update_slice(cache["global_k"][j], k, (0, start, 0, 0))  # [B, S, kv, hd]
            vs = jax.lax.dynamic_update_slice(cache["global_v"][j], v, (0, start, 0, 0))
            # o [B, T, kv, g, hd]
            o = masked_attention(q, ks, vs, _visible(positions, global_pos, jnp.iinfo(jnp.int32).max))
            new_k["global"].append(ks)
            new_v["global"].append(vs)
        else:
            j = loc.index(i)
            # the ring before this chunk plus the chunk itself: every cached token appears once
            ks = jnp.concatenate([cache["local_k"][j], k], axis=1)  # [B, W + T, kv, hd]
            vs = jnp.concatenate([cache["local_v"][j], v], axis=1)
            key_pos = jnp.concatenate([local_pos_before, positions], axis=1)  # [B, W + T]
            o = masked_attention(q, ks, vs, _visible(positions, key_pos, cfg.sliding_window))  # [B, T, kv, g, hd]
            new_k["local"].append(cache["local_k"][j].at[:, slots].set(k[:, t - keep:]))
            new_v["local"].append(cache["local_v"][j].at[:, slots].set(v[:, t - keep:]))
        x = x + o.reshape(b, t, h * hd) @ p["wo"]  # [B, T, d]
        out, _ = moe_block(rmsnorm(x, p["mlp_norm"], cfg.norm_eps), p, router_bias[i], cfg, mesh, transport)
        x = x + out
    for kind in ("global", "local"):
        if new_k[kind]:
            new[f"{kind}_k"] = jnp.stack(new_k[kind])
            new[f"{kind}_v"] = jnp.stack(new_v[kind])
    new["global_pos"] = global_pos
    new["local_pos"] = local_pos_before.at[:, slots].set(positions[:, t - keep:].astype(jnp.int32))
    new["length"] = start + t
    return output_logits(x, params, cfg), new


# ---- choosing the next token ----------------------------------------------------------------------
def next_tokens(logits, key, sampling: Sampling):
    """logits f32 [B, V] -> token ids int32 [B]. Pure; the same key gives the same draw."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]  # [B, 1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p is not None and sampling.top_p < 1:
        order = jnp.argsort(-logits, axis=-1)  # [B, V], most likely first
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)  # [B, V]
        # keep a token if the probability of the more likely ones is still below top_p (the first always)
        before = jnp.cumsum(probs, axis=-1) - probs
        drop_sorted = before >= sampling.top_p
        drop = jnp.zeros_like(drop_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(drop_sorted)
        logits = jnp.where(drop, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


# ---- generating -----------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("cfg", "mesh"), donate_argnames=("cache",))
def _step(params, router_bias, cache, tokens, positions, cfg, mesh):
    logits, cache = decode_step(params, router_bias, cache, tokens, positions, cfg, mesh)
    return logits[:, -1], cache


@functools.partial(jax.jit, static_argnames=("sampling", "mesh"))
def _choose(logits, step, sampling, mesh=None):
    """The next token of every row; on a mesh replicated on every device, since every process of a
    pool (one per host) feeds all rows back and decides when decoding stops: a few bytes per row."""
    key = jax.random.fold_in(jax.random.PRNGKey(sampling.seed), step)
    tok = next_tokens(logits, key, sampling)
    return tok if mesh is None else jax.lax.with_sharding_constraint(tok, replicated(mesh))


def tokens_to_host(tok) -> np.ndarray:
    """The chosen tokens in this process: its own copy of a replicated array (which works where the
    array spans several processes, unlike reading the global value)."""
    return np.asarray(tok if tok.is_fully_addressable else tok.addressable_data(0))


def prompt_width(longest: int, limit: int) -> int:
    """The padded prompt width: the next power of two (at least 8, at most ``limit``), so requests of
    many lengths share a few compiled programs instead of one per length (left padding is free:
    padded positions are -1 and never attended)."""
    width = 8
    while width < longest:
        width *= 2
    return max(longest, min(width, limit))


def generate_tokens(params, router_bias, cfg: MoEConfig, prompts: list[list[int]], max_new_tokens: int,
                    sampling: Sampling = GREEDY, *, stop_ids: tuple[int, ...] = (),
                    mesh=None) -> list[list[int]]:
    """New token ids for each prompt (token id lists of any lengths), batched in one cache.

    A row stops after emitting one of ``stop_ids`` (which is kept, so callers see why it stopped);
    generation ends when every row stopped or after ``max_new_tokens``. On a ``mesh`` the rows are
    padded to a multiple of its devices (the tokens are split over every device); a mesh may span
    several processes (a pool's hosts), each of which calls this with the same arguments and gets
    the same tokens."""
    check_prompts(prompts, cfg, max_new_tokens)
    n = len(prompts)
    rows = n if mesh is None else -(-n // mesh.size) * mesh.size
    width = prompt_width(max(len(p) for p in prompts), cfg.max_seq_len - max_new_tokens)
    tokens = np.zeros((rows, width), np.int32)
    positions = np.full((rows, width), -1, np.int32)
    for r in range(rows):
        p = prompts[r] if r < n else prompts[0]  # mesh padding rows repeat a prompt; their output is dropped
        tokens[r, width - len(p):] = p
        positions[r, width - len(p):] = np.arange(len(p))
    # cache columns rounded up to a multiple of 32 as well: fewer distinct programs, little memory
    cache = init_cache(cfg, rows, width + -(-max_new_tokens // 32) * 32)
    if mesh is not None:
        params = jax.device_put(params, param_shardings(params, mesh))
        router_bias = jax.device_put(router_bias, replicated(mesh))
    logits, cache = _step(params, router_bias, cache, jnp.asarray(tokens), jnp.asarray(positions), cfg, mesh)
    next_pos = positions[:, -1] + 1
    out = [[] for _ in range(n)]
    done = np.zeros(n, bool)
    stops = set(int(s) for s in stop_ids)
    for step in range(max_new_tokens):
        tok = _choose(logits, step, sampling, mesh)
        host = tokens_to_host(tok)
        for r in range(n):
            if not done[r]:
                out[r].append(int(host[r]))
                done[r] = int(host[r]) in stops
        if done.all() or step == max_new_tokens - 1:
            break
        logits, cache = _step(params, router_bias, cache, tok[:, None], jnp.asarray(next_pos[:, None]), cfg, mesh)
        next_pos = next_pos + 1
    return out
