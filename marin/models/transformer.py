"""The MoE transformer, in plain JAX: a params pytree of arrays and pure functions.

    tokens [B, L+1] -> inputs tokens[:, :-1], targets tokens[:, 1:]
    x = embed[inputs]
    for each layer (a lax.scan over stacked weights; window = sliding_window or global):
        x = x + attention(rmsnorm(x))                    GQA, RoPE, causal (+ window, + documents);
                                                        dense [L, L] scores or blocked (online softmax)
        x = x + moe(rmsnorm(x))                          shared SwiGLU experts on x
                                                        + latent_up(routed experts(latent_down(x)))
    logits = rmsnorm(x) @ lm_head
    loss = mean CE + z_loss_weight * mean(logsumexp(logits)^2)

The router bias is an input (training state), not a parameter: it only steers top-k selection.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from marin.models import router as rt
from marin.models.blocked_attention import blocked_attention, expand_kv_heads
from marin.models.config import MoEConfig
from marin.models.context_parallel import ContextParallel, check_split
from marin.models.params import check_param_tree
from marin.parallel.transports import moe_experts

GLOBAL_WINDOW = 1 << 30  # "window" of a global layer


# ---- params ---------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=0)
def init_params(cfg: MoEConfig, key: jax.Array) -> dict:
    """float32 params. Stacked per-layer weights have a leading [n_layers] axis; routed expert
    weights are [n_layers, n_experts, ...]. Fan-in scaled normal init; residual outputs get an extra
    1/sqrt(2 n_layers). Routed experts are drawn at ``expert_width`` and zero-padded to
    ``stored_expert_width`` (padding units exactly zero: the same function, the same draws as unpadded).

    One compiled program per config (``cfg`` is static): run op by op, each leaf's draw, scale and pad
    would compile a small program of its own."""
    L, d, E = cfg.n_layers, cfg.d_model, cfg.n_experts
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.stored_kv_heads * cfg.head_dim
    lat, f, fs = cfg.latent_dim, cfg.expert_width, cfg.n_shared_experts * cfg.shared_width
    pad = cfg.stored_expert_width - f
    keys = iter(jax.random.split(key, 16))
    out_scale = 1.0 / math.sqrt(2 * L)

    def normal(shape, fan_in, scale=1.0):
        return jax.random.normal(next(keys), shape, jnp.float32) * (scale / math.sqrt(fan_in))

    # a layer with fewer KV heads than stored uses the first ones; its other columns are zero
    kv_used = (jnp.arange(kv_dim)[None, :] < jnp.array([cfg.kv_heads_of(i) * cfg.head_dim for i in range(L)])[:, None])
    kv_used = kv_used[:, None, :].astype(jnp.float32)  # [L, 1, kv_dim]
    blocks = {
        "attn_norm": jnp.ones((L, d), jnp.float32),
        "wq": normal((L, d, q_dim), d),
        "wk": normal((L, d, kv_dim), d) * kv_used,
        "wv": normal((L, d, kv_dim), d) * kv_used,
        "wo": normal((L, q_dim, d), q_dim, out_scale),
        "mlp_norm": jnp.ones((L, d), jnp.float32),
        "shared_gate": normal((L, d, fs), d),
        "shared_up": normal((L, d, fs), d),
        "shared_down": normal((L, fs, d), max(fs, 1), out_scale),
        "latent_down": normal((L, d, lat), d),
        "latent_up": normal((L, lat, d), lat, out_scale),
        "router": normal((L, lat, E), lat),
        "expert_gate": jnp.pad(normal((L, E, lat, f), lat), ((0, 0), (0, 0), (0, 0), (0, pad))),
        "expert_up": jnp.pad(normal((L, E, lat, f), lat), ((0, 0), (0, 0), (0, 0), (0, pad))),
        "expert_down": jnp.pad(normal((L, E, f, lat), f), ((0, 0), (0, 0), (0, pad), (0, 0))),
    }
    params = {"embed": normal((cfg.vocab_size, d), 1.0), "blocks": blocks, "final_norm": jnp.ones((d,), jnp.float32)}
    if not cfg.tie_embeddings:
        params["lm_head"] = normal((d, cfg.vocab_size), d)
    check_param_tree(params)  # every leaf has a role (the mesh, the optimizer and the export read it)
    return params


def init_router_bias(cfg: MoEConfig) -> jax.Array:
    return jnp.zeros((cfg.n_moe_layers, cfg.n_experts), jnp.float32)


def layer_windows(cfg: MoEConfig) -> jax.Array:
    return jnp.array([GLOBAL_WINDOW if w is None else w for w in cfg.layer_windows()], jnp.int32)


# ---- layers ---------------------------------------------------------------------------------
def rmsnorm(x, w, eps):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)  # [..., d] f32, unit RMS per row
    return (y * w).astype(x.dtype)


def rope(x, positions, theta):
    """Rotary embedding on the last axis (split-half convention). x [B, L, ..., hd], positions [L]
    (shared by every row) or [B, L] (per row: decoding left-padded prompts of different lengths)."""
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [L, hd/2] or [B, L, hd/2]
    lead = (1, ang.shape[0]) if positions.ndim == 1 else ang.shape[:2]
    ang = ang.reshape(lead + (1,) * (x.ndim - 3) + (hd // 2,))
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attention_mask(seq_len: int, window, segment_ids=None):
    """[B or 1, L, L] bool: key j visible from query i iff j <= i and i - j < window (and same document)."""
    i = jnp.arange(seq_len)[:, None]
    j = jnp.arange(seq_len)[None, :]
    mask = ((j <= i) & (i - j < window))[None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return mask


def layer_kv(k, v, window, cfg: MoEConfig):
    """K and V [B, L, stored, hd] of a layer as its attention reads them: a global layer (``window``
    = GLOBAL_WINDOW, traced inside the layer scan) with fewer KV heads than stored expands its own."""
    stored = cfg.stored_kv_heads
    for used, is_kind in ((cfg.kv_heads_global, window >= GLOBAL_WINDOW), (cfg.n_kv_heads, window < GLOBAL_WINDOW)):
        if used != stored:
            k = jnp.where(is_kind, expand_kv_heads(k, used, stored), k)
            v = jnp.where(is_kind, expand_kv_heads(v, used, stored), v)
    return k, v


def attention(x, p, window, segment_ids, cfg: MoEConfig, positions=None, context=None):
    """One attention layer: x [B, L, d] -> [B, L, d]. ``positions`` [B, L]: each row's token positions
    (default 0..L-1); ``context``: a :class:`marin.models.context_parallel.ContextParallel` when each
    row is one shard of a longer sequence split over devices."""
    b, l, _ = x.shape
    h, kv, hd = cfg.n_heads, cfg.stored_kv_heads, cfg.head_dim
    q = (x @ p["wq"]).reshape(b, l, kv, h // kv, hd)  # [B, L, kv, g, hd]: g = h / kv query heads per kv head
    k = (x @ p["wk"]).reshape(b, l, kv, hd)  # [B, L, kv, hd]
    v = (x @ p["wv"]).reshape(b, l, kv, hd)  # [B, L, kv, hd]
    pos = jnp.arange(l) if positions is None else positions
    q, k = rope(q, pos, cfg.rope_theta), rope(k, pos, cfg.rope_theta)
    if context is not None:
        o = context.attention(q, k, v, window, segment_ids, cfg)  # [B, L, kv, g, hd]
        return o.reshape(b, l, h * hd) @ p["wo"]
    k, v = layer_kv(k, v, window, cfg)
    if cfg.attention_impl == "blocked":
        o = blocked_attention(q, k, v, window, segment_ids, block=cfg.attention_block)  # [B, L, kv, g, hd]
    else:
        o = dense_attention(q, k, v, window, segment_ids)  # [B, L, kv, g, hd]
    return o.reshape(b, l, h * hd) @ p["wo"]  # [B, L, d]


def dense_attention(q, k, v, window, segment_ids=None):
    """q [B, L, kv, g, hd], k, v [B, L, kv, hd] -> [B, L, kv, g, hd] through the full [L, L] scores."""
    return masked_attention(q, k, v, attention_mask(q.shape[1], window, segment_ids))


def masked_attention(q, k, v, mask):
    """q [B, Lq, kv, g, hd], k, v [B, Lk, kv, hd], mask bool [B or 1, Lq, Lk] (key visible from
    query) -> [B, Lq, kv, g, hd]. Shared by the training forward (Lq = Lk) and cached decoding
    (Lq = the new tokens, Lk = the cache). A query that sees no key gets a uniform average, not NaN."""
    s = jnp.einsum("bqkgh,bskh->bkgqs", q, k, preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
    s = jnp.where(mask[:, None, None], s, -1e30)  # [B, kv, g, Lq, Lk] f32 scores
    probs = jax.nn.softmax(s, axis=-1).astype(q.dtype)  # [B, kv, g, Lq, Lk]
    return jnp.einsum("bkgqs,bskh->bqkgh", probs, v)  # [B, Lq, kv, g, hd]


def swiglu(x, w_gate, w_up, w_down):
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down  # [T, d_in] -> [T, f] -> [T, d_out]


def moe_block(x, p, bias, cfg: MoEConfig, mesh, transport: str, grouped_impl: str | None = None):
    """x [B, L, d] (already normed) -> (out [B, L, d], per-layer stats). ``grouped_impl``: the routed
    experts' grouped compute (`marin.kernels.grouped`; None = the platform's rule)."""
    b, l, d = x.shape
    xf = x.reshape(b * l, d)  # [T, d], T = B * L tokens
    shared = swiglu(xf, p["shared_gate"], p["shared_up"], p["shared_down"])  # [T, d]
    z = xf @ p["latent_down"]  # [T, latent]
    # expert_ids, weights [T, k]; scores [T, E]
    expert_ids, weights, scores = rt.route(z, p["router"], bias, cfg.top_k, cfg.normalize_combine)
    experts = {"gate": p["expert_gate"], "up": p["expert_up"], "down": p["expert_down"]}
    y, drops = moe_experts(z, expert_ids, weights.astype(z.dtype), experts, n_experts=cfg.n_experts,
                           transport=transport, mesh=mesh, capacity_factor=cfg.capacity_factor,
                           expert_chunks=cfg.expert_chunks, grouped_impl=grouped_impl)
    out = shared + y @ p["latent_up"]  # y [T, latent] -> out [T, d]
    stats = {
        "expert_load": rt.expert_load(expert_ids, cfg.n_experts),
        "send_drops": drops["send_drops"],
        "recv_drops": drops["recv_drops"],
        "assignments": drops["assignments"],
    }
    if cfg.router_bias_update == "quantile":
        hist = rt.margin_histogram(scores, bias, cfg.top_k, cfg.router_hist_bins)
        stats["bias_hist"] = hist  # additive over microbatches (gradient accumulation)
        stats["bias_target"] = rt.bias_target_from_histogram(hist, bias, scores.shape[0], cfg.top_k)
    return out.reshape(b, l, d), stats


def _remat(fn, policy: str):
    if policy == "none":
        return fn
    policies = {
        "full": None,
        "dots": jax.checkpoint_policies.checkpoint_dots,
        "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    }
    return jax.checkpoint(fn, policy=policies[policy])


# ---- the model ------------------------------------------------------------------------------
def forward(params, router_bias, inputs, cfg: MoEConfig, *, mesh=None, transport: str | None = None,
            segment_ids=None, positions=None, context: ContextParallel | None = None,
            grouped_impl: str | None = None):
    """inputs int [B, L] -> (logits f32 [B, L, V], stacked per-layer stats). With ``context`` the
    rows are context-parallel shards (:meth:`ContextParallel.rows`) and ``positions`` their tokens'
    positions in their sequences. ``grouped_impl`` picks the routed experts' grouped compute, like
    ``transport`` a choice of how, not what (None: the platform's rule)."""
    transport = transport or cfg.transport
    dt = jnp.dtype(cfg.dtype)
    cast = lambda a: a.astype(dt)  # noqa: E731
    x = cast(params["embed"])[inputs]  # [B, L, d]

    def layer(x, xs):
        p, bias, window = xs
        p = jax.tree.map(cast, p)
        x = x + attention(rmsnorm(x, p["attn_norm"], cfg.norm_eps), p, window, segment_ids, cfg,
                          positions, context)  # [B, L, d]
        y, stats = moe_block(rmsnorm(x, p["mlp_norm"], cfg.norm_eps), p, bias, cfg, mesh, transport,
                             grouped_impl)  # y [B, L, d]
        return x + y, stats

    layer = _remat(layer, cfg.remat_policy)
    # x [B, L, d]; stats stacked [n_layers, ...]
    x, stats = jax.lax.scan(layer, x, (params["blocks"], router_bias, layer_windows(cfg)))
    return output_logits(x, params, cfg), stats


def output_logits(x, params, cfg: MoEConfig):
    """The last residual stream x [B, L, d] -> logits f32 [B, L, V] (final norm, then the head)."""
    dt = jnp.dtype(cfg.dtype)
    h = rmsnorm(x, params["final_norm"].astype(dt), cfg.norm_eps)  # [B, L, d]
    if cfg.tie_embeddings:
        # logits [B, L, V] f32
        logits = jnp.einsum("bld,vd->blv", h, params["embed"].astype(dt), preferred_element_type=jnp.float32)
        return logits / math.sqrt(cfg.d_model)
    # logits [B, L, V] f32
    return jnp.einsum("bld,dv->blv", h, params["lm_head"].astype(dt), preferred_element_type=jnp.float32)


def loss_and_stats(params, router_bias, tokens, cfg: MoEConfig, *, mesh=None, transport: str | None = None,
                   segment_ids=None, grouped_impl: str | None = None):
    """tokens int32 [B, L+1] -> (mean CE + z_loss_weight * z_loss, stats). Differentiable w.r.t. params;
    router_bias is stop-gradient'ed. segment_ids [B, L+1] or [B, L] (document ids) masks attention
    across documents."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # [B, L] each
    b, seq = inputs.shape
    if segment_ids is not None:
        segment_ids = segment_ids[:, :seq]
    router_bias = jax.lax.stop_gradient(router_bias)
    context = positions = None
    if cfg.context_parallel > 1:  # each sequence split over context_parallel devices (the mean is the same)
        if mesh is None:
            raise ValueError("context_parallel > 1 needs a mesh to split the sequences over")
        check_split(b, seq, cfg.context_parallel, mesh)
        context = ContextParallel(mesh, cfg.context_parallel, cfg.attention_block)
        inputs, targets, positions = context.rows(inputs), context.rows(targets), context.positions(b, seq)
        segment_ids = None if segment_ids is None else context.rows(segment_ids)
    logits, layer_stats = forward(params, router_bias, inputs, cfg, mesh=mesh, transport=transport,
                                  segment_ids=segment_ids, positions=positions, context=context,
                                  grouped_impl=grouped_impl)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B, L]
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # [B, L]
    ce = jnp.mean(lse - target_logit)  # scalar
    zl = jnp.mean(lse**2)
    loss = ce + cfg.z_loss_weight * zl
    assignments = layer_stats["assignments"]
    stats = {
        "ce_loss": ce,
        "z_loss": zl,
        "drop_frac_send": jnp.sum(layer_stats["send_drops"]) / jnp.sum(assignments),
        "drop_frac_recv": jnp.sum(layer_stats["recv_drops"]) / jnp.sum(assignments),
        "drop_frac_send_per_layer": layer_stats["send_drops"] / assignments,
        "drop_frac_recv_per_layer": layer_stats["recv_drops"] / assignments,
        "expert_load": layer_stats["expert_load"],
        "max_over_mean_load": jnp.mean(jnp.max(layer_stats["expert_load"], axis=-1)
                                       / jnp.mean(layer_stats["expert_load"], axis=-1)),
    }
    if "bias_target" in layer_stats:
        stats["bias_target"] = layer_stats["bias_target"]
        stats["bias_hist"] = layer_stats["bias_hist"]
    return loss, stats


def update_router_bias(router_bias, stats, cfg: MoEConfig) -> jax.Array:
    """Next step's router bias [n_layers, E] from this step's stats (pure)."""
    rate = cfg.bias_rate()
    if cfg.router_bias_update == "quantile":
        if "bias_target" not in stats:
            raise KeyError("quantile bias update needs stats['bias_target'] (run loss_and_stats with this cfg)")
        return rt.quantile_update(router_bias, stats["bias_target"], rate)
    return rt.sign_update(router_bias, stats["expert_load"], rate)
