"""Lower the complete train step for another platform without its devices (no compile, no GPU).

A CPU-only machine can trace and lower the exact program a GPU pool runs: an abstract mesh of the
pool's shape (``jax.sharding.AbstractMesh``), abstract state and batch (``jax.ShapeDtypeStruct`` with
shardings), platform-specific choices made for the target (``marin.jaxcompat.lowering_for``) and
``Traced.lower(lowering_platforms=(platform,))``. CI uses it to prove every transport's GPU program
(forward, backward, AdamW, router-bias update), and the evaluator's forward, build at the production
mesh shape and hold no host callback or CPU-only custom call; the memory planner's validation
compiles the same step for CPU.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType

from marin.evaluation.evaluator import nll_fn
from marin.jaxcompat import lowering_for
from marin.parallel.mesh import DATA, EXPERT, batch_sharding, replicated
from marin.training.config import TrainConfig
from marin.training.trainer import build_train_step, state_shapes, state_shardings


def abstract_mesh(data: int, expert: int) -> AbstractMesh:
    """A (data, expert) mesh with no devices behind it (same axis names and types as make_mesh)."""
    return AbstractMesh((data, expert), (DATA, EXPERT), axis_types=(AxisType.Auto, AxisType.Auto))


def abstract_state(config: TrainConfig, cfg, mesh) -> tuple[Any, Any]:
    """(state as ShapeDtypeStructs carrying their shardings, the shardings tree): the shapes of
    the sharded init (trainer.init_state) without allocating them (the hero's 535B parameters included)."""
    shapes = state_shapes(config, cfg)
    shardings = state_shardings(shapes, mesh, config.parallelism.param_sharding)
    state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
    return state, shardings


def abstract_batch(mesh, batch_size: int, seq_len: int, context_parallel: int = 1) -> tuple[jax.ShapeDtypeStruct, ...]:
    """(tokens, segment_ids, lr) as the step receives them: [B, L+1] int32 split over the batch."""
    tok = jax.ShapeDtypeStruct((batch_size, seq_len + 1), jnp.int32,
                               sharding=batch_sharding(mesh, context_parallel))
    lr = jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated(mesh))
    return tok, tok, lr


def lower_train_step(config: TrainConfig, cfg, mesh_shape: tuple[int, int], transport: str, *, batch_size: int,
                     seq_len: int, platform: str = "cuda", mesh=None, microbatches: int = 1):
    """The jitted train step of ``transport``, traced for ``platform`` and lowered (not compiled).

    ``mesh`` defaults to an abstract mesh of ``mesh_shape``; pass a concrete one to compile the
    result on this machine (the planner's validation)."""
    mesh = abstract_mesh(*mesh_shape) if mesh is None else mesh
    with lowering_for(platform):
        state, shardings = abstract_state(config, cfg, mesh)
        step = build_train_step(config, cfg, mesh, transport, shardings, microbatches)
        traced = step.trace(state, *abstract_batch(mesh, batch_size, seq_len, cfg.context_parallel))
        return traced.lower(lowering_platforms=(platform,))


def lower_eval_forward(config: TrainConfig, cfg, mesh_shape: tuple[int, int], *, batch_size: int, seq_len: int,
                       platform: str = "cuda"):
    """The evaluator's jitted forward (per-token NLL, ``marin.evaluation.evaluator.nll_fn``) traced for
    ``platform`` on an abstract mesh of ``mesh_shape`` and lowered (not compiled)."""
    mesh = abstract_mesh(*mesh_shape)
    with lowering_for(platform):
        state, _ = abstract_state(config, cfg, mesh)
        rows = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=batch_sharding(mesh))
        traced = nll_fn(cfg, mesh).trace(state["params"], state["router_bias"], rows, rows, rows)
        return traced.lower(lowering_platforms=(platform,))


# Ops that mean "this runs on the host", and custom calls only XLA:CPU can execute.
_HOST_PATTERNS = (
    r"xla_python_cpu_callback", r"xla_python_gpu_callback", r"xla_ffi_python_cpu_callback",
    r"xla_ffi_python_gpu_callback", r"host_callback", r"SendToHost|RecvFromHost",
    r"_xla_host_transfer", r"mhlo\.sharding\s*=\s*\"\{maximal device=CPU",
)
_CPU_ONLY_CUSTOM_CALLS = (r"marin_\w+", r"lapack_\w+", r"cpu_\w+")


def forbidden_ops(text: str) -> list[str]:
    """Host callbacks and CPU-only custom calls in a lowered module's text (empty = GPU-clean)."""
    found = [m.group(0) for pat in _HOST_PATTERNS for m in re.finditer(pat, text)]
    for target in re.findall(r"stablehlo\.custom_call\s*@([\w.]+)", text):
        if any(re.fullmatch(p, target) for p in _CPU_ONLY_CUSTOM_CALLS):
            found.append(target)
    return sorted(set(found))


def custom_call_targets(text: str) -> list[str]:
    return sorted(set(re.findall(r"stablehlo\.custom_call\s*@([\w.]+)", text)))
