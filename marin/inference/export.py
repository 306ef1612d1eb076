"""``marin export``: a run's weights as safetensors shards any framework can read, with a config,
the tokenizer, a numpy reference forward and a model card that says where the weights came from.

Shards are filled in file order up to ``max_shard_bytes`` (a tensor larger than that gets a shard of
its own) and written one at a time: only one shard's tensors are ever on the host, sliced from the
model as they are written (:func:`marin.models.exported.exported_tensor`). The layout (names,
shapes, ``y = x @ W``) is documented in :mod:`marin.models.exported` and docs/use.md.
"""

from __future__ import annotations

import json
import os
import shutil
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import fsspec

from marin.data.tokenizer import tokenizer_json_path
from marin.execution.executor import experiment_record_paths, read_experiment_record
from marin.execution.status import read_info
from marin.models import numpy_forward
from marin.models.config import count_params
from marin.models.exported import CONFIG_FILE, INDEX_FILE, config_record, exported_shapes, exported_tensor
from marin.training.metrics import read_metrics

DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
CARD_FILE = "README.md"
REFERENCE_FILE = "reference_forward.py"


class ExportError(ValueError):
    """An export that would overwrite something, or cannot be written."""


def plan_shards(shapes: dict[str, tuple[int, ...]], max_shard_bytes: int, itemsize: int = 4) -> list[list[str]]:
    """Tensor names per shard: file order, each shard at most ``max_shard_bytes`` unless a single
    tensor is larger (then it is alone). Pure."""
    if max_shard_bytes < 1:
        raise ExportError(f"max shard size must be positive, got {max_shard_bytes}")
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        n = itemsize
        for s in shape:
            n *= s
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def marin_version() -> str:
    try:
        return version("marin")
    except PackageNotFoundError:
        return "unknown"


def check_output_dir(out_dir: str, overwrite: bool) -> None:
    if os.path.isfile(out_dir):
        raise ExportError(f"{out_dir} is a file: give a directory to export into")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        if not overwrite:
            raise ExportError(f"{out_dir} is not empty: choose a new directory or pass --overwrite to replace it")
        shutil.rmtree(out_dir)


def export_model(params, router_bias, cfg, out_dir: str, *, tokenizer_path: str | None = None,
                 lineage: dict[str, Any] | None = None, overwrite: bool = False,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict[str, Any]:
    """Write an export directory; returns ``{"dir", "shards", "tensors", "total_size"}``."""
    from safetensors.numpy import save_file  # safetensors: the train extra, only when writing

    check_output_dir(out_dir, overwrite)
    os.makedirs(out_dir, exist_ok=True)
    shapes = exported_shapes(cfg)
    plan = plan_shards(shapes, max_shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for k, names in enumerate(plan, start=1):
        fname = f"model-{k:05d}-of-{len(plan):05d}.safetensors"
        tensors = {n: exported_tensor(params, router_bias, cfg, n) for n in names}
        save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "np"})
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update({n: fname for n in names})
        del tensors
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    lineage = lineage or {}
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(config_record(cfg, marin_version=marin_version(), lineage=lineage), f,
                  indent=1)
    if tokenizer_path:
        with fsspec.open(tokenizer_json_path(tokenizer_path), "rb") as src, \
                open(os.path.join(out_dir, "tokenizer.json"), "wb") as dst:
            dst.write(src.read())
    shutil.copyfile(numpy_forward.__file__, os.path.join(out_dir, REFERENCE_FILE))
    with open(os.path.join(out_dir, CARD_FILE), "w") as f:
        f.write(model_card(cfg, lineage, len(plan), total))
    return {"dir": out_dir, "shards": len(plan), "tensors": len(shapes), "total_size": total}


def run_lineage(run) -> dict[str, Any]:
    """Where a run's weights come from: step name and hash, experiment, data, tokens, evaluations."""
    run_dir = run.run_dir.rstrip("/")
    base = os.path.basename(run_dir)
    name, _, step_hash = base.rpartition("-")
    info = read_info(run_dir) or {}
    record = run.record
    data = record.get("data") or {}
    lineage: dict[str, Any] = {
        "run_dir": run_dir, "step_name": info.get("name") or name or base, "step_hash": step_hash or None,
        "experiment": _experiment_of(run_dir, info), "checkpoint_step": run.step,
        "train_tokens": int(run.metadata.get("tokens", 0)), "preset": record.get("preset"),
        "pool": record.get("pool"), "data": data if "stores" in data else {"synthetic": data},
    }
    try:
        evals = read_metrics(f"{run.run_dir.rstrip('/')}/metrics.jsonl", kind="eval")
    except (FileNotFoundError, OSError):
        evals = []
    if evals:
        last = evals[-1]
        lineage["eval"] = {k: v for k, v in last.items() if k.startswith("eval/") or k in ("step", "tokens")}
    return lineage


def _experiment_of(run_dir: str, info: dict[str, Any]) -> str | None:
    """``script: description`` of the newest experiment record under ``{prefix}/experiments`` that
    lists this step, or None for a run started outside the executor."""
    suffix = f"/{info.get('name')}-{run_dir.rpartition('-')[2]}"  # output path = {prefix}/{name}-{hash}
    if not info.get("name") or not run_dir.endswith(suffix):
        return None
    prefix = run_dir[: -len(suffix)]
    found = []
    for path in experiment_record_paths(prefix):
        rec = read_experiment_record(path)
        if isinstance(rec, dict) and any(s.get("output_path", "").rstrip("/") == run_dir for s in rec.get("steps", [])):
            found.append(rec)
    if not found:
        return None
    rec = max(found, key=lambda r: r.get("updated") or 0)
    return f"{rec.get('script')}: {rec.get('description')}" if rec.get("description") else rec.get("script")


def model_card(cfg, lineage: dict[str, Any], shards: int, total: int) -> str:
    c = count_params(cfg)
    lines = [
        f"# {lineage.get('step_name') or 'marin model'}",
        "",
        "A mixture-of-experts transformer trained with marin. No transformers architecture matches it exactly "
        "(latent-compressed routed experts, a sigmoid router balanced by a per-expert bias), so the tensors are "
        "documented below and `reference_forward.py` (numpy + safetensors only) runs it:",
        "",
        "    python reference_forward.py . 1 2 3",
        "",
        "or, with marin installed, `marin.models.load_exported(DIR)` gives JAX params with the run's logits.",
        "",
        "## Lineage",
        "",
        f"- training step: `{lineage.get('step_name')}` hash `{lineage.get('step_hash')}` ({lineage.get('run_dir')})",
        f"- experiment: {lineage.get('experiment') or 'not recorded'}",
        f"- checkpoint step: {lineage.get('checkpoint_step')}, training tokens: {lineage.get('train_tokens', 0):,}",
        f"- data: {json.dumps(lineage.get('data'))}",
        f"- preset: {lineage.get('preset')}, pool: {lineage.get('pool')}",
    ]
    ev = lineage.get("eval")
    if ev:
        lines += ["", "## Evaluation (last in-training eval)", ""]
        lines += [f"- {k}: {v:.4f}" if isinstance(v, float) else f"- {k}: {v}" for k, v in ev.items()]
    lines += [
        "",
        "## Model",
        "",
        f"- {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads ({cfg.n_kv_heads} kv), head_dim "
        f"{cfg.head_dim}, vocab {cfg.vocab_size}, context {cfg.max_seq_len}",
        f"- attention: sliding window {cfg.sliding_window}, every {cfg.global_every}th layer and the last global",
        f"- MoE: {cfg.n_shared_experts} shared experts (width {cfg.shared_width}), {cfg.n_experts} routed experts "
        f"(width {cfg.expert_width}, top-{cfg.top_k}) in a latent space of {cfg.latent_dim}",
        f"- parameters: {c['total_params']:,} total, {c['active_params']:,} active per token",
        f"- files: {shards} safetensors shard(s), {total:,} bytes of float32 tensors",
        "",
        "## Tensors (y = x @ W)",
        "",
        "| name | shape |",
        "|---|---|",
    ]
    shapes = exported_shapes(cfg)
    for name, shape in shapes.items():
        if name.startswith("layers.") and not name.startswith("layers.0."):
            continue
        lines.append(f"| `{name.replace('layers.0.', 'layers.{i}.')}` | {list(shape)} |")
    return "\n".join(lines) + "\n"


def export_run(run, out_dir: str, *, overwrite: bool = False,
               max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict[str, Any]:
    """Export a :class:`marin.inference.LoadedRun` (its tokenizer and lineage included)."""
    tok = run.tokenizer
    return export_model(run.params, run.router_bias, run.cfg, out_dir, tokenizer_path=tok.path if tok else None,
                        lineage=run_lineage(run), overwrite=overwrite, max_shard_bytes=max_shard_bytes)
