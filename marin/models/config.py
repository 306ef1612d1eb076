"""Model configuration, presets, and parameter / FLOP accounting for the MoE transformer.

Everything here is pure Python (no JAX), so the CLI and the scaling code can import it cheaply.

The model (see docs/model.md):
  embed -> n_layers x [RMSNorm -> attention (GQA + RoPE, local or global) -> residual,
                       RMSNorm -> MoE block -> residual] -> RMSNorm -> lm_head
  MoE block: shared SwiGLU experts on the full-width input
             + latent down-projection d -> latent, router on the latent, top-k of n_experts routed
               SwiGLU experts computed in the latent space, combine, latent up-projection latent -> d.

Parameters are counted as the published figures of the Marin 535B-A23B run count them (535.3B total,
22.76B active): the model's weight arrays as the published model stores them. The K/V projections are
stored at the larger KV-head count on every layer (marin-community/marin ``experiments/grug/moe_hero_ep/model.py``
keeps ``w_k``/``w_v`` at ``[d, stored_kv_heads x head_dim]`` and every layer multiplies by all of it), so
they are counted at that width; routed experts count at ``expert_width`` (the published width; our
padding for sharding is not in the published model). "Active" = what one token's forward multiplies
through in the transformer blocks: attention, norms, router, latent projections, shared experts and
top_k of the routed experts; the input embedding and the output head are in the total, NOT in
"active" (the published hero and ladder figures reconcile only that way; d768's head alone exceeds its
published 61M active). docs/model.md reconciles the hero's counts with the published ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from marin.execution.fieldcheck import check_fields
from marin.execution.versioning import added_later
from marin.models.params import params_of
from marin.parallel.capacity import (  # noqa: F401  (re-exported for model configs)
    DEFAULT_EXPERT_CHUNKS,
    EP_TRANSPORTS,
    TRANSPORTS,
)
from marin.runsteps import phase_weights

REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
ROUTER_BIAS_UPDATES = ("quantile", "sign")
DTYPES = ("float32", "bfloat16")
ATTENTION_IMPLS = ("dense", "blocked")


@dataclass(frozen=True)
class MoEConfig:
    # sizes
    vocab_size: int = 128_256
    d_model: int = 6144
    n_layers: int = 48
    n_heads: int = 48
    # KV heads of the local (sliding-window) layers, and of the global layers unless
    # n_kv_heads_global says otherwise (the published hero: 12 local, 6 global)
    n_kv_heads: int = 12
    n_kv_heads_global: int | None = added_later(default=None)
    head_dim: int = 128
    max_seq_len: int = 4096
    # attention pattern: layer i is global iff i % global_every == global_every - 1 or i is the last
    sliding_window: int = 1024
    global_every: int = 4
    rope_theta: float = 500_000.0
    # "dense" materialises the [L, L] scores; "blocked" runs an online softmax over blocks of
    # attention_block positions (memory O(L x block), the same function up to summation order)
    attention_impl: str = "dense"  # "dense" | "blocked"
    attention_block: int = 512
    # split each sequence over this many devices of the expert axis (marin.models.context_parallel):
    # how the work is spread, not what is computed; trainers set it per sequence-length phase
    context_parallel: int = added_later(default=1)
    # MoE block
    latent_dim: int = 3072
    n_experts: int = 384
    top_k: int = 8
    expert_width: int = 3072
    # the stored expert width is expert_width rounded up to this multiple; the extra hidden units are
    # zero and stay zero (an exact no-op, see stored_expert_width), so the width can divide a mesh axis
    expert_width_multiple: int = 1
    n_shared_experts: int = 2
    shared_width: int = 3072
    normalize_combine: bool = True  # combine weights = selected sigmoid scores / their sum
    # losses
    z_loss_weight: float = 1e-4
    # expert parallelism
    # capacity_factor bounds the buffers of the transports that can drop ("fixed": per expert;
    # "ragged_capacity": per chunk of a device's local experts); "dropless" and "ragged" never drop
    capacity_factor: float = 1.15
    transport: str = "local"  # "local" | "fixed" | "dropless" | "ragged" | "ragged_capacity"
    # "ragged_capacity": the chunks of local experts a receiving device runs one after the other,
    # each with one buffer pooled over its experts (the published run: 2 chunks of 3 experts)
    expert_chunks: int = added_later(default=DEFAULT_EXPERT_CHUNKS)
    # router balancing (bias lives in the training state, not in params)
    router_bias_update: str = "quantile"  # "quantile" | "sign"
    # quantile: fraction of the way to move towards the balancing bias (1.0 = jump there);
    # sign: the step size gamma. None = 1.0 for quantile, 1e-3 for sign.
    router_bias_rate: float | None = None
    router_hist_bins: int = 1024
    # misc
    remat_policy: str = "none"  # "none" | "full" | "dots" | "dots_no_batch"
    tie_embeddings: bool = False
    dtype: str = "float32"  # compute dtype; params are kept in float32
    norm_eps: float = 1e-5

    FIELD_RANGES: ClassVar[dict[str, str]] = {
        "vocab_size": ">= 1", "d_model": ">= 1", "n_layers": ">= 1", "n_heads": ">= 1", "n_kv_heads": ">= 1",
        "n_kv_heads_global": ">= 1", "head_dim": ">= 1", "max_seq_len": ">= 1", "sliding_window": ">= 1",
        "global_every": ">= 1", "rope_theta": "> 0", "attention_block": ">= 1", "context_parallel": ">= 1",
        "latent_dim": ">= 1", "n_experts": ">= 1", "top_k": ">= 1", "expert_width": ">= 1",
        "expert_width_multiple": ">= 1", "n_shared_experts": ">= 0", "shared_width": ">= 1",
        "z_loss_weight": ">= 0", "capacity_factor": "> 0", "expert_chunks": ">= 1", "router_bias_rate": "> 0",
        "router_hist_bins": ">= 1", "norm_eps": "> 0"}
    """Each numeric field's range (its type is checked by its annotation): a size, count or width no
    model can have (0, negative, fractional) is refused where the config is built, in one line naming
    ``model.<field>``, before a division by it or an array of it fails deep inside the model."""

    def __post_init__(self):
        check_fields(self, "model.", self.FIELD_RANGES)

        def check(cond, msg):
            if not cond:
                raise ValueError(f"MoEConfig: {msg}")

        check(self.n_heads % self.n_kv_heads == 0, "n_heads must be a multiple of n_kv_heads")
        check(self.n_kv_heads_global is None or self.n_heads % self.n_kv_heads_global == 0,
              f"n_kv_heads_global must be a divisor of n_heads, got {self.n_kv_heads_global!r}")
        check(self.stored_kv_heads % self.n_kv_heads == 0 and self.stored_kv_heads % self.kv_heads_global == 0,
              "the larger of n_kv_heads and n_kv_heads_global must be a multiple of the smaller")
        check(self.top_k <= self.n_experts, f"top_k ({self.top_k}) must be at most n_experts ({self.n_experts})")
        check(self.transport in TRANSPORTS, f"transport must be one of {TRANSPORTS}")
        check(self.remat_policy in REMAT_POLICIES, f"remat_policy must be one of {REMAT_POLICIES}")
        check(self.router_bias_update in ROUTER_BIAS_UPDATES,
              f"router_bias_update must be one of {ROUTER_BIAS_UPDATES}")
        check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}")
        check(self.head_dim % 2 == 0, "head_dim must be even (RoPE)")
        check(self.attention_impl in ATTENTION_IMPLS, f"attention_impl must be one of {ATTENTION_IMPLS}, "
              f"got {self.attention_impl!r}")

    # ---- derived -------------------------------------------------------------------------
    @property
    def n_moe_layers(self) -> int:
        return self.n_layers  # every layer has a MoE block

    @property
    def stored_expert_width(self) -> int:
        """The routed experts' hidden width as stored and computed: ``expert_width`` rounded up to
        ``expert_width_multiple``. JAX shards a dimension only when the mesh axis divides it, so the
        hero pads 3072 to 3080 = 11 x 280 to split its experts over 11 racks. The padding units have
        zero columns in gate/up and zero rows in down: their output silu(0) * 0 = 0 adds nothing, and
        every gradient into them is exactly zero, so AdamW (zero moments, zero update, decoupled weight
        decay of a zero) keeps them zero: the padded model computes the unpadded one exactly."""
        m = self.expert_width_multiple
        return -(-self.expert_width // m) * m

    @property
    def kv_heads_global(self) -> int:
        """KV heads of the global (full-causal) layers."""
        return self.n_kv_heads if self.n_kv_heads_global is None else self.n_kv_heads_global

    @property
    def stored_kv_heads(self) -> int:
        """KV heads the stacked K/V projections are stored at: the larger of the two counts (one
        stacked [n_layers, d, heads x head_dim] leaf serves every layer, as in the upstream hero model).
        A layer with fewer heads uses the first ones and leaves the rest of its columns zero: no
        gradient reaches them (they are never read) and AdamW keeps a zero at zero, so the stored
        model computes the published one exactly, as with ``stored_expert_width``."""
        return max(self.n_kv_heads, self.kv_heads_global)

    def kv_heads_of(self, i: int) -> int:
        """KV heads of layer ``i``."""
        return self.kv_heads_global if self.is_global_layer(i) else self.n_kv_heads

    def is_global_layer(self, i: int) -> bool:
        return i % self.global_every == self.global_every - 1 or i == self.n_layers - 1

    def layer_windows(self) -> list[int | None]:
        """Attention window per layer; None means global (full causal)."""
        return [None if self.is_global_layer(i) else self.sliding_window for i in range(self.n_layers)]

    def bias_rate(self) -> float:
        if self.router_bias_rate is not None:
            return self.router_bias_rate
        return 1.0 if self.router_bias_update == "quantile" else 1e-3

    def replace(self, **overrides) -> "MoEConfig":
        return dataclasses.replace(self, **overrides)


# ---- presets --------------------------------------------------------------------------------
def _ladder(d: int, n_layers: int, **kw) -> MoEConfig:
    """The hero recipe at width d: head_dim 128, GQA 4:1 on the local layers and 8:1 on the global
    ones, sliding window 2,048, latent = expert width = shared width = d/2, 384 experts top-8,
    2 shared experts, blocked attention (the 8K-262K phases cannot hold [L, L])."""
    n_heads = d // 128
    n_kv, n_kv_global = max(1, n_heads // 4), max(1, n_heads // 8)
    kw.setdefault("n_kv_heads_global", None if n_kv_global == n_kv else n_kv_global)
    kw.setdefault("sliding_window", 2048)
    return MoEConfig(d_model=d, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
                     head_dim=128, latent_dim=d // 2, expert_width=d // 2, shared_width=d // 2,
                     attention_impl="blocked", **kw)


PRESETS: dict[str, MoEConfig] = {
    # 535B-A23B hero (the published Marin run): 48 heads, 12 KV heads on the local layers and 6 on the
    # global ones, sliding window 2,048 (marin-community/marin experiments/grug/moe_hero_ep/README.md).
    # expert_width_multiple 11: the stored width 3080 splits over the 11 racks of its mesh (fsdp)
    "hero": _ladder(6144, 48, dtype="bfloat16", remat_policy="dots", expert_width_multiple=11),
    # scaling ladder rungs (the hero recipe at their widths); layer counts are fitted to the published
    # totals (d3072/d4096 interpolated)
    "d768": _ladder(768, 8, dtype="bfloat16"),
    "d2048": _ladder(2048, 22, dtype="bfloat16", remat_policy="dots"),
    "d3072": _ladder(3072, 28, dtype="bfloat16", remat_policy="dots"),
    "d4096": _ladder(4096, 36, dtype="bfloat16", remat_policy="dots"),
    # CPU presets: train in seconds
    "tiny": MoEConfig(vocab_size=512, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
                      max_seq_len=128, sliding_window=32, latent_dim=32, n_experts=4, top_k=2,
                      expert_width=32, n_shared_experts=1, shared_width=32, dtype="float32"),
    "tiny-ep": MoEConfig(vocab_size=512, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
                         max_seq_len=128, sliding_window=32, latent_dim=32, n_experts=8, top_k=2,
                         expert_width=32, n_shared_experts=1, shared_width=32, dtype="float32",
                         transport="fixed"),
}

# Published figures of the Marin 535B-A23B run and its ladder, for checks: preset -> (total, active)
PUBLISHED = {
    "hero": (535.3e9, 22.76e9),
    "d768": (1.6e9, 61e6),
    "d2048": (27.7e9, 1.2e9),
}


def get_preset(name: str, **overrides) -> MoEConfig:
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}")
    cfg = PRESETS[name]
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


# ---- accounting -----------------------------------------------------------------------------
def count_params(cfg: MoEConfig) -> dict:
    """Exact parameter counts (router bias excluded: it is training state, not a parameter), as the
    published figures count them (module docstring): ``total_params`` and ``active_params`` hold the
    K/V projections at ``stored_kv_heads`` on every layer, ``kv_padding`` of which are the columns a
    layer with fewer KV heads never reads (zero, and kept at zero). Routed experts count at
    ``expert_width``; ``stored_params`` counts the pytree transformer.init_params builds, experts at
    ``stored_expert_width`` (zero padding units, see MoEConfig.stored_expert_width): what memory holds."""
    d, L = cfg.d_model, cfg.n_layers
    # q, o, k, v of each layer at its own KV-head count (what the layer's attention reads)
    attn_layers = [d * cfg.n_heads * cfg.head_dim * 2 + d * cfg.kv_heads_of(i) * cfg.head_dim * 2 for i in range(L)]
    # the stored K/V columns the layers with fewer KV heads leave unread
    kv_padding = sum(2 * d * (cfg.stored_kv_heads - cfg.kv_heads_of(i)) * cfg.head_dim for i in range(L))
    attn_stored = sum(attn_layers) + kv_padding
    norms = 2 * d  # attn_norm, mlp_norm
    router = cfg.latent_dim * cfg.n_experts
    latent = 2 * d * cfg.latent_dim  # down + up
    one_expert = 3 * cfg.latent_dim * cfg.expert_width  # gate, up, down
    shared = 3 * d * cfg.shared_width * cfg.n_shared_experts
    routed_total = one_expert * cfg.n_experts
    routed_active = one_expert * cfg.top_k
    embed = cfg.vocab_size * d
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    final_norm = d

    rest_total = norms + router + latent + shared + routed_total
    rest_active = norms + router + latent + shared + routed_active
    routed_padding = 3 * cfg.latent_dim * (cfg.stored_expert_width - cfg.expert_width) * cfg.n_experts
    total = attn_stored + L * rest_total + embed + head + final_norm
    active = attn_stored + L * rest_active + final_norm
    return {
        "total_params": total,
        "stored_params": total + L * routed_padding,
        "active_params": active,
        "active_params_with_head": active + cfg.vocab_size * d,
        # of the two counts above: the stored K/V columns no layer reads (the hero's global layers
        # store 12 KV heads and read 6); multiplied on the device, so not in the model FLOPs
        "kv_padding": kv_padding,
        "embedding": embed,
        "lm_head": head,
        "attention": attn_stored,
        "norms": L * norms + final_norm,
        "router": L * router,
        "latent_proj": L * latent,
        "shared_experts": L * shared,
        "routed_experts_total": L * routed_total,
        "routed_experts_active": L * routed_active,
        "per_layer_total": round(attn_stored / L) + rest_total,
        "per_layer_active": round(attn_stored / L) + rest_active,
    }


def param_shapes(cfg: MoEConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every parameter leaf transformer.init_params builds, keyed ``"embed"``, ``"final_norm"``,
    ``"lm_head"`` (untied only) and ``"blocks/<leaf>"`` (stacked: a leading [n_layers] axis): the
    parameter table's (:data:`marin.models.params.PARAMS`, which gives each its role). JAX-free, so
    the memory planner can apply the mesh's sharding rule leaf by leaf."""
    return {k: tuple(p.shape(cfg)) for k, p in params_of(cfg).items()}


def mean_attended_keys(seq_len: int, window: int | None) -> float:
    """Average number of keys a query attends to under causal masking (and a sliding window):
    mean over positions i in [0, seq_len) of min(i + 1, window)."""
    w = seq_len if window is None else min(window, seq_len)
    # positions 0..w-1 attend to i+1 keys, the rest attend to w keys
    return (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len


def flops_per_token(cfg: MoEConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward):
    6 x (active_params - kv_padding - norms + output head) + the attention scores/values term
    12 x n_heads x head_dim x mean attended keys, per layer (causal mask and windows counted).

    Model FLOPs, the usual convention for MFU: the matmuls the model's function needs. The device also
    multiplies by two kinds of zero columns, the routed experts' units past ``expert_width`` (padding
    to ``stored_expert_width``) and the K/V columns a layer with fewer KV heads never reads
    (``kv_padding``); they do no useful work, and counting them would make a padded run look more
    efficient than the same model unpadded, so N here is ``active_params`` less ``kv_padding``. The
    planner, the trainer's MFU and the scaling recipe all take their FLOPs from here."""
    c = count_params(cfg)
    matmul_active = c["active_params"] - c["kv_padding"] - c["norms"] + cfg.vocab_size * cfg.d_model  # + lm head
    dense = 6.0 * matmul_active
    attn = 0.0
    for w in cfg.layer_windows():
        attn += 12.0 * cfg.n_heads * cfg.head_dim * mean_attended_keys(seq_len, w)
    return dense + attn


def mean_flops_per_token(cfg: MoEConfig, seq_len_phases: Sequence[tuple[float, int]],
                         train_steps: int | None = None) -> float:
    """Training FLOPs per token averaged over a run's sequence-length phases ``((start fraction,
    seq_len), ...)`` at constant tokens per step: each phase weighted by its share of the run's steps,
    placed with the trainer's rounding (:func:`marin.runsteps.phase_weights`) when ``train_steps`` is
    known, by the fractions otherwise. The one rule the planner, the recipe and the ladder use."""
    return sum(w * flops_per_token(cfg, n) for w, n in phase_weights(seq_len_phases, train_steps))


def summary(cfg: MoEConfig, seq_len: int | None = None) -> dict:
    seq_len = seq_len or cfg.max_seq_len
    c = count_params(cfg)
    return {
        "total_params": c["total_params"],
        "active_params": c["active_params"],
        "active_params_with_head": c["active_params_with_head"],
        "flops_per_token": flops_per_token(cfg, seq_len),
        "seq_len": seq_len,
        "layers": cfg.n_layers,
        "d_model": cfg.d_model,
        "num_experts": cfg.n_experts,
        "top_k": cfg.top_k,
        "n_heads": cfg.n_heads,
        "n_kv_heads": cfg.n_kv_heads,
        "n_kv_heads_global": cfg.kv_heads_global,
        "sliding_window": cfg.sliding_window,
        "latent_dim": cfg.latent_dim,
        "expert_width": cfg.expert_width,
        "stored_expert_width": cfg.stored_expert_width,
        "n_shared_experts": cfg.n_shared_experts,
        "global_every": cfg.global_every,
        "global_layers": [i for i in range(cfg.n_layers) if cfg.is_global_layer(i)],
        "breakdown": c,
    }
