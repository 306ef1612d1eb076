"""The marin MoE transformer in numpy alone: run an exported model without the trainer.

Needs numpy and safetensors (no JAX, no marin); ``marin export`` ships this file as
``reference_forward.py`` next to the weights, so it can be copied anywhere::

    python reference_forward.py EXPORT_DIR 1 2 3      # logits of the last position, top 5 tokens

or from Python::

    config, tensors = load(EXPORT_DIR)
    logits = forward(tensors, config, [[1, 2, 3]])   # float32 [batch, length, vocab]

Written to be read top to bottom; slow on purpose (float32, dense attention, experts one by one).
Per layer i (matrices applied as x @ W)::

    h = x + attention(rmsnorm(x) ; wq, wk, wv, wo)      GQA, RoPE (split halves), causal, and for a
                                                       local layer a sliding window of ``sliding_window``
    z = rmsnorm(h) ; s = sigmoid((z @ latent_down) @ router)      router scores in (0, 1)
    experts = top_k(s + router_bias)                   the bias only chooses; weights are s / sum(s)
    x = h + swiglu(z ; shared) + (sum_e w_e swiglu(z @ latent_down ; expert e)) @ latent_up

A layer is global iff ``i % global_every == global_every - 1`` or it is the last one.
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np


def load(directory: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(the ``model`` section of config.json, {tensor name: float32 array}) of an export directory
    (bfloat16 tensors are widened to float32 exactly: their bytes are a float32's upper half)."""
    from safetensors import deserialize  # safetensors: the train extra, only when an export is read

    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)["model"]
    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    tensors: dict[str, np.ndarray] = {}
    for shard in shards:
        with open(os.path.join(directory, shard), "rb") as f:
            for name, t in deserialize(f.read()):
                if t["dtype"] == "BF16":
                    a = (np.frombuffer(t["data"], "<u2").astype(np.uint32) << 16).view(np.float32)
                else:
                    a = np.frombuffer(t["data"], "<f4")
                tensors[name] = a.reshape(t["shape"])
    return config, tensors


def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, theta):
    """x [B, L, heads, hd] -> rotated by position (0..L-1), split-half convention."""
    length, hd = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd)
    ang = np.arange(length, dtype=np.float32)[:, None] * inv_freq[None, :]  # [L, hd/2]
    cos, sin = np.cos(ang)[None, :, None, :], np.sin(ang)[None, :, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def softmax(s, axis=-1):
    s = s - np.max(s, axis=axis, keepdims=True)
    e = np.exp(s)
    return e / np.sum(e, axis=axis, keepdims=True)


def silu(x):
    return x / (1.0 + np.exp(-x))


def swiglu(x, gate, up, down):
    return (silu(x @ gate) * (x @ up)) @ down


def attention(x, t, i, c, window):
    b, length, _ = x.shape
    h, hd = c["n_heads"], c["head_dim"]
    kv = t[f"layers.{i}.wk"].shape[1] // hd  # this layer's KV heads (global layers may have fewer)
    q = rope((x @ t[f"layers.{i}.wq"]).reshape(b, length, h, hd), c["rope_theta"])
    k = rope((x @ t[f"layers.{i}.wk"]).reshape(b, length, kv, hd), c["rope_theta"])
    v = (x @ t[f"layers.{i}.wv"]).reshape(b, length, kv, hd)
    k, v = np.repeat(k, h // kv, axis=2), np.repeat(v, h // kv, axis=2)  # query head j uses kv head j // (h/kv)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    qi, kj = np.arange(length)[:, None], np.arange(length)[None, :]
    visible = (kj <= qi) & (qi - kj < window)
    scores = np.where(visible[None, None], scores, -1e30)
    out = np.einsum("bhqk,bkhd->bqhd", softmax(scores), v)
    return out.reshape(b, length, h * hd) @ t[f"layers.{i}.wo"]


def moe(x, t, i, c):
    b, length, d = x.shape
    xf = x.reshape(-1, d)
    p = f"layers.{i}."
    shared = swiglu(xf, t[p + "shared_gate"], t[p + "shared_up"], t[p + "shared_down"])
    z = xf @ t[p + "latent_down"]
    scores = 1.0 / (1.0 + np.exp(-(z @ t[p + "router"])))
    chosen = np.argsort(-(scores + t[p + "router_bias"][None, :]), axis=-1, kind="stable")[:, : c["top_k"]]
    weights = np.take_along_axis(scores, chosen, axis=-1)
    if c["normalize_combine"]:
        weights = weights / np.sum(weights, axis=-1, keepdims=True)
    routed = np.zeros_like(z)
    for tok in range(z.shape[0]):
        for e, w in zip(chosen[tok], weights[tok]):
            routed[tok] += w * swiglu(z[tok], t[p + "expert_gate"][e], t[p + "expert_up"][e], t[p + "expert_down"][e])
    return (shared + routed @ t[p + "latent_up"]).reshape(b, length, d)


def forward(tensors: dict[str, np.ndarray], config: dict, tokens) -> np.ndarray:
    """Logits float32 [B, L, vocab] of token ids ``tokens`` [B, L] (every row from position 0)."""
    c, t = config, tensors
    tokens = np.asarray(tokens, np.int64)
    x = t["embed"][tokens].astype(np.float32)
    n = c["n_layers"]
    for i in range(n):
        is_global = i % c["global_every"] == c["global_every"] - 1 or i == n - 1
        window = tokens.shape[1] + 1 if is_global else c["sliding_window"]
        x = x + attention(rmsnorm(x, t[f"layers.{i}.attn_norm"], c["norm_eps"]), t, i, c, window)
        x = x + moe(rmsnorm(x, t[f"layers.{i}.mlp_norm"], c["norm_eps"]), t, i, c)
    h = rmsnorm(x, t["final_norm"], c["norm_eps"])
    if c["tie_embeddings"]:
        return (h @ t["embed"].T / math.sqrt(c["d_model"])).astype(np.float32)
    return (h @ t["lm_head"]).astype(np.float32)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit("usage: python reference_forward.py EXPORT_DIR TOKEN_ID [TOKEN_ID ...]")
    cfg, weights = load(sys.argv[1])
    last = forward(weights, cfg, [[int(a) for a in sys.argv[2:]]])[0, -1]
    top = np.argsort(-last)[:5]
    print(json.dumps({"top_tokens": top.tolist(), "logits": [float(last[j]) for j in top]}))
