"""What the training-side benchmarks share: model flags, the pool's JAX environment, the run state.

`train_bench.py` and `eval_bench.py` build the same model on the same pool from the same flags; this
is the one place that does it (`decode_bench.py` and `optimizer_bench.py` take its preset flags alone).
Import it before JAX: :func:`pool_environment` must set the fake device count first.
"""

from __future__ import annotations

import argparse
import ast
import os
from typing import Any


def add_preset_flags(p: argparse.ArgumentParser, model: str = "tiny-ep") -> None:
    """The flags that choose the model: a preset's name and its fields overridden (:func:`parse_overrides`)."""
    p.add_argument("--model", default=model)
    p.add_argument("--override", action="append", default=[], help="model field=value, repeatable")


def add_model_flags(p: argparse.ArgumentParser, seq_len: int) -> None:
    """The flags that choose the model and its batch: preset, pool, tokens per step, dtype, overrides."""
    add_preset_flags(p)
    p.add_argument("--pool", default="local-cpu")
    p.add_argument("--tokens-per-step", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=seq_len)
    p.add_argument("--dtype", default=None, help="compute dtype override, e.g. bfloat16")


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["n_layers=4", "dtype=bfloat16"]`` -> ``{"n_layers": 4, "dtype": "bfloat16"}`` (Python literals
    where they parse, strings otherwise)."""
    out: dict[str, Any] = {}
    for kv in items:
        k, v = kv.split("=", 1)
        try:
            out[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            out[k] = v
    return out


def pool_environment(pool_name: str):
    """The pool, with this process's JAX environment set for it (fake CPU devices); call before importing jax."""
    from marin.pools import get_pool

    pool = get_pool(pool_name)
    if pool.is_cpu:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={pool.devices_per_host}"
    return pool


def train_setup(args: argparse.Namespace) -> dict[str, Any]:
    """Config, resolved model, synthetic data, mesh, initial host state and shardings for ``args``."""
    pool = pool_environment(args.pool)  # before anything imports jax
    from marin.models.config import get_preset
    from marin.parallel.mesh import batch_sharding, make_mesh
    from marin.training.config import SyntheticDataConfig, TelemetryConfig, TrainConfig
    from marin.training.trainer import init_host_state, model_config, state_shardings

    dtype = {} if args.dtype is None else {"dtype": args.dtype}
    config = TrainConfig(output_path="", data=SyntheticDataConfig(vocab_size=512), preset=args.model,
                         model=get_preset(args.model, **{**parse_overrides(args.override), **dtype}), pool=args.pool,
                         tokens_per_step=args.tokens_per_step, seq_len_phases=((0.0, args.seq_len),),
                         telemetry=TelemetryConfig(wandb_project=None))
    cfg = model_config(config)
    mesh = make_mesh(*pool.mesh)
    host_state = init_host_state(config, cfg)
    return {"pool": pool, "config": config, "cfg": cfg, "data": SyntheticDataConfig(vocab_size=cfg.vocab_size),
            "mesh": mesh, "host_state": host_state, "shardings": state_shardings(host_state, mesh),
            "sharding": batch_sharding(mesh)}
