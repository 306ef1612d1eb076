"""Will sampling from a model fit a pool: per-device memory of ``marin sample`` / ``marin eval``.

What one device holds while a batch of ``batch`` sequences of up to ``context`` positions decodes
(:func:`marin.models.decode.generate_tokens`): the weights (restored as the checkpoint stores them,
float32 master weights unless told otherwise, each layer cast to the compute dtype as it runs;
routed experts split over the pool's "expert" axis, the rest replicated or split over the mesh
under ``param_sharding``), the KV cache (global layers one column per position, the sliding-window
layers a ring of ``sliding_window`` slots; its shapes come from the decoder's own
:func:`marin.models.decode.init_cache`, so a change to the attention shape is counted as it is
built), and the activations of the widest step, the prefill of the whole context (one layer live at
a time: projections, dense attention's float32 scores over the cache, the routed experts' rows, and
the float32 logits of every position). The rows are split over every device of the pool, as
decoding pads them to a multiple of its devices.
"""

from __future__ import annotations

import math
from typing import Any

from marin.models.config import MoEConfig
from marin.pools import PoolSpec
from marin.training.planning import activation_bytes_per_token_layer, device_memory_bytes, params_per_device

WEIGHT_DTYPES = ("float32", "bfloat16")


def kv_cache_bytes(cfg: MoEConfig, rows: int, context: int) -> dict[str, int]:
    """Bytes of the decoder's cache for ``rows`` sequences of ``context`` positions, by part:
    ``global`` (full-length layers), ``local`` (the sliding-window layers' rings) and ``positions``."""
    # JAX's abstract evaluation only: the decoder's own cache shapes, nothing allocated
    import jax

    from marin.models.decode import init_cache  # JAX (see above)

    shapes = jax.eval_shape(lambda: init_cache(cfg, rows, context))
    out = {"global": 0, "local": 0, "positions": 0}
    for name, s in shapes.items():
        n = math.prod(s.shape) * s.dtype.itemsize
        if name.endswith("_pos") or name == "length":
            out["positions"] += n
        elif name.startswith("global"):
            out["global"] += n
        else:
            out["local"] += n
    return out


def inference_plan(cfg: MoEConfig, pool: PoolSpec, *, batch: int, context: int, weights_dtype: str = "float32",
                   param_sharding: str = "replicated") -> dict[str, Any]:
    """Per-device bytes of decoding ``batch`` sequences of up to ``context`` positions on ``pool``,
    and whether they fit its device memory."""
    if batch < 1:
        raise ValueError(f"--batch must be at least 1, got {batch}")
    if not 1 <= context <= cfg.max_seq_len:
        raise ValueError(f"--context must be between 1 and the model's max_seq_len {cfg.max_seq_len}, got {context}")
    if weights_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weights dtype must be one of {WEIGHT_DTYPES}, got {weights_dtype!r}")
    devices = pool.num_devices
    rows = -(-batch // devices)  # per device: the rows are padded to a multiple of the devices
    p = params_per_device(cfg, tuple(pool.mesh), param_sharding)
    weights = p["total"] * (4 if weights_dtype == "float32" else 2)
    kv = kv_cache_bytes(cfg, rows, context)
    tokens = rows * context  # the prefill: every position of every row in one step
    a = activation_bytes_per_token_layer(cfg.replace(attention_impl="dense"), context, cfg.top_k)
    layer = a["dots_nobatch"] + a["dots_batch"] + a["other"]  # one layer live at a time
    c = 2 if cfg.dtype == "bfloat16" else 4
    one_layer_weights = (p["total"] - p["embed_head"]) / cfg.n_layers * c  # the layer cast to the compute dtype
    parts = {"weights": int(weights), "kv_cache_global": kv["global"], "kv_cache_local": kv["local"],
             "kv_positions": kv["positions"], "activations": int(tokens * (layer + a["carry"]) + one_layer_weights),
             "logits": int(tokens * cfg.vocab_size * 4)}
    total = sum(parts.values())
    memory = device_memory_bytes(pool)
    return {"pool": pool.name, "devices": devices, "batch": batch, "rows_per_device": rows, "context": context,
            "weights_dtype": weights_dtype, "param_sharding": param_sharding, "per_device": parts, "total": total,
            "device_memory": memory, "fits": total <= memory}


def format_inference_plan(p: dict[str, Any]) -> str:
    gib = 1024**3
    d = p["per_device"]
    lines = [
        f"sampling on {p['pool']} ({p['devices']} devices): batch {p['batch']} ({p['rows_per_device']} row(s) per "
        f"device), context {p['context']}",
        f"  weights ({p['weights_dtype']}, {p['param_sharding']}): {d['weights'] / gib:.2f} GiB per device",
        f"  KV cache: {d['kv_cache_global'] / gib:.2f} GiB in global layers, {d['kv_cache_local'] / gib:.2f} GiB in "
        "the sliding-window layers' rings",
        f"  activations (prefill of the context, one layer at a time): {d['activations'] / gib:.2f} GiB, "
        f"logits {d['logits'] / gib:.2f} GiB",
        f"  total {p['total'] / gib:.2f} GiB of {p['device_memory'] / gib:.2f} GiB per device: "
        + ("fits" if p["fits"] else "does NOT fit"),
    ]
    return "\n".join(lines)
