"""The exported-weights format: tensor names and shapes, to and from the model's params pytree.

An export directory (``marin export``) holds ``model-0000K-of-0000N.safetensors`` shards,
``model.safetensors.index.json`` (the Hugging Face sharded layout: ``weight_map`` name -> shard),
``config.json`` (``"model"``: every MoEConfig field), ``tokenizer.json``, a model card and
``reference_forward.py`` (numpy only). Tensors are bfloat16 (the default, ``torch_dtype`` in
config.json says which) or float32, one per layer and leaf::

    embed                    [vocab, d]
    final_norm               [d]
    lm_head                  [d, vocab]              (absent with tie_embeddings)
    layers.{i}.attn_norm     [d]
    layers.{i}.wq            [d, n_heads * head_dim]
    layers.{i}.wk, .wv       [d, kv_i * head_dim]        kv_i: n_kv_heads on local layers, n_kv_heads_global
                                                        (when set) on global ones
    layers.{i}.wo            [n_heads * head_dim, d]
    layers.{i}.mlp_norm      [d]
    layers.{i}.shared_gate, .shared_up   [d, n_shared * shared_width]
    layers.{i}.shared_down   [n_shared * shared_width, d]
    layers.{i}.latent_down   [d, latent]
    layers.{i}.latent_up     [latent, d]
    layers.{i}.router        [latent, n_experts]
    layers.{i}.router_bias   [n_experts]             (training state: steers top-k, not the weights)
    layers.{i}.expert_gate, .expert_up   [n_experts, latent, expert_width]
    layers.{i}.expert_down   [n_experts, expert_width, latent]

Matrices are applied as ``y = x @ W`` (input dimension first; PyTorch's ``nn.Linear`` stores the
transpose). Routed experts are exported at their real ``expert_width``: the zero padding units a
mesh may need (``stored_expert_width``) are dropped, and added back on load; likewise each layer's
K/V projections at its own KV-head count (``stored_kv_heads`` pads the smaller kind with zeros).

This module needs numpy only, except :func:`load_exported` (JAX, imported there).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable

import numpy as np

from marin.models.config import MoEConfig
from marin.models.params import PARAMS, leaf_name
from marin.parallel.roles import EMBEDDING

FORMAT = "marin-moe-v1"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"

EXPORT_DTYPES = ("bfloat16", "float32")


def to_export_dtype(a: np.ndarray, dtype: str) -> np.ndarray:
    """A float32 tensor as written in an export of ``dtype``: as is, or rounded to the nearest
    bfloat16 (ties to even, as ``ml_dtypes``/JAX/PyTorch cast)."""
    if dtype == "float32":
        return np.ascontiguousarray(a, np.float32)
    if dtype == "bfloat16":
        import ml_dtypes  # numpy's bfloat16 (a JAX dependency; the reference reader needs only numpy)

        return np.ascontiguousarray(a, np.float32).astype(ml_dtypes.bfloat16)
    raise ValueError(f"export dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")


def read_shard(path: str) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file as float32 numpy arrays, bfloat16 ones widened exactly
    (safetensors' numpy reader has no bfloat16: the raw bytes are its upper 16 bits)."""
    from safetensors import deserialize  # safetensors: the train extra; config and shapes need numpy only

    with open(path, "rb") as f:
        raw = f.read()
    out = {}
    for name, t in deserialize(raw):
        if t["dtype"] == "BF16":
            a = (np.frombuffer(t["data"], "<u2").astype(np.uint32) << 16).view(np.float32)
        elif t["dtype"] == "F32":
            a = np.frombuffer(t["data"], "<f4")
        else:
            raise ExportFormatError(f"{path}: tensor {name} is {t['dtype']}, not F32 or BF16")
        out[name] = a.reshape(t["shape"])
    return out


class ExportFormatError(ValueError):
    """A directory that is not a complete marin export (missing or inconsistent files)."""


def exported_shapes(cfg: MoEConfig) -> dict[str, tuple[int, ...]]:
    """Every exported tensor's name and shape, in file order: the embedding, each layer's leaves, then
    the other unstacked leaves (the final norm, the head), all from the parameter table."""
    table = {k: p for k, p in PARAMS.items() if p.present(cfg)}
    unstacked = [k for k in table if not k.startswith("blocks/")]
    out = {k: _exported_shape(table[k], cfg, None) for k in unstacked if table[k].role == EMBEDDING}
    for i in range(cfg.n_layers):
        out.update({f"layers.{i}.{leaf_name(k)}": _exported_shape(p, cfg, i) for k, p in table.items()
                    if k.startswith("blocks/")})
    out.update({k: _exported_shape(table[k], cfg, None) for k in unstacked if table[k].role != EMBEDDING})
    return out


def _exported_shape(param, cfg: MoEConfig, layer: int | None) -> tuple[int, ...]:
    """One exported tensor's shape: the table's exported shape, else the stored one (one layer's)."""
    if param.exported is not None:
        return tuple(param.exported(cfg, layer))
    shape = tuple(param.shape(cfg))
    return shape if layer is None else shape[1:]


def _stored(name: str) -> str:
    """The table's key of an exported tensor's name (``layers.3.wq`` -> ``blocks/wq``)."""
    return f"blocks/{name.split('.')[2]}" if name.startswith("layers.") else name


def exported_tensor(params, router_bias, cfg: MoEConfig, name: str) -> np.ndarray:
    """One exported tensor (float32 numpy) cut from the params pytree: only that slice is copied to
    the host, so an exporter holds one shard at a time, never the whole model. The padding the mesh
    needs (a routed expert's extra width, a layer's unused K/V heads) is at the end of each axis, so
    the exported tensor is the stored one cut to its exported shape."""
    if not name.startswith("layers."):
        a = params[name]
    else:
        _, i, leaf = name.split(".")
        source = router_bias if PARAMS[_stored(name)].state else params["blocks"][leaf]
        a = source[int(i)]
    a = a[tuple(slice(0, n) for n in exported_shape(cfg, name))]
    # contiguous: a numpy view of the padded storage has strides safetensors would not honour
    return np.ascontiguousarray(np.asarray(a, np.float32))


def exported_shape(cfg: MoEConfig, name: str) -> tuple[int, ...]:
    """The exported shape of one tensor ``name`` (``layers.3.wk``, ``embed``)."""
    layer = int(name.split(".")[1]) if name.startswith("layers.") else None
    return _exported_shape(PARAMS[_stored(name)], cfg, layer)


def params_from_tensors(get: Callable[[str], np.ndarray], cfg: MoEConfig) -> tuple[dict, np.ndarray]:
    """(params pytree of numpy arrays, router bias [n_layers, n_experts]) from exported tensors
    (``get(name)``), stacked per layer and zero-padded at the end of each axis to the stored shape."""
    shapes = exported_shapes(cfg)

    def take(name):
        a = np.asarray(get(name), np.float32)
        if tuple(a.shape) != shapes[name]:
            raise ExportFormatError(f"tensor {name} has shape {list(a.shape)}, config.json implies "
                                    f"{list(shapes[name])}")
        return a

    def stored(key, a):
        full = PARAMS[key].shape(cfg)[1 if key.startswith("blocks/") else 0:]
        return np.pad(a, [(0, n - m) for n, m in zip(full, a.shape)])

    params: dict = {"blocks": {}}
    bias = None
    for key, param in PARAMS.items():
        if not param.present(cfg):
            continue
        if not key.startswith("blocks/"):
            params[key] = stored(key, take(key))
            continue
        stacked = np.stack([stored(key, take(f"layers.{i}.{leaf_name(key)}")) for i in range(cfg.n_layers)])
        if param.state:
            bias = stacked
        else:
            params["blocks"][leaf_name(key)] = stacked
    return params, bias


def config_record(cfg: MoEConfig, dtype: str = "float32", **extra) -> dict:
    """The ``config.json`` object: format, every MoEConfig field, plus ``extra`` (version, lineage)."""
    return {"format": FORMAT, "architecture": "marin MoE transformer (see reference_forward.py)",
            "tensor_layout": "y = x @ W (input dimension first)", "torch_dtype": dtype,
            "model": dataclasses.asdict(cfg), **extra}


def config_from_record(record: dict) -> MoEConfig:
    if record.get("format") != FORMAT or "model" not in record:
        raise ExportFormatError(f"config.json is not a {FORMAT} export (format {record.get('format')!r})")
    return MoEConfig(**record["model"])


def read_export(directory: str) -> tuple[MoEConfig, dict, np.ndarray]:
    """(config, numpy params (float32), numpy router bias) of an export directory (local path)."""
    try:
        with open(os.path.join(directory, CONFIG_FILE)) as f:
            cfg = config_from_record(json.load(f))
        with open(os.path.join(directory, INDEX_FILE)) as f:
            weight_map = json.load(f)["weight_map"]
    except FileNotFoundError as e:
        missing = os.path.basename(e.filename)
        raise ExportFormatError(f"{directory} is not a marin export: {missing} is missing") from None
    missing = [n for n in exported_shapes(cfg) if n not in weight_map]
    if missing:
        raise ExportFormatError(f"{directory}: {INDEX_FILE} lacks {len(missing)} tensors, e.g. {missing[0]}")
    shards: dict[str, dict[str, np.ndarray]] = {}

    def get(name):
        shard = weight_map[name]
        if shard not in shards:
            shards[shard] = read_shard(os.path.join(directory, shard))
        return shards[shard][name]

    params, bias = params_from_tensors(get, cfg)
    return cfg, params, bias


def load_exported(directory: str):
    """``(cfg, params, router_bias)`` of an export directory as JAX arrays: the same logits as the run
    it was exported from (``marin.models.transformer.forward(params, router_bias, tokens, cfg)``)."""
    import jax  # kept out of the module: config, shapes and reading need numpy only

    cfg, params, bias = read_export(directory)
    return cfg, jax.device_put(params), jax.device_put(bias)
