"""A trained model loaded from a run's checkpoint (config, params, router bias; no optimizer state),
onto any mesh, for evaluation, sampling and export.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from marin.execution.jsonable import from_jsonable
from marin.training.checkpoint.discovery import checkpoint_path, checkpoint_step
from marin.training.checkpoint.format import read_metadata
from marin.training.checkpoint.restore import read_checkpoint, restore_checkpoint


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A training run's model at one checkpoint: what sampling, export and evaluation need."""

    config: Any  # marin.models.config.MoEConfig, exactly as the run trained it
    params: Any  # nested dict of arrays (global jax Arrays on the mesh given, or numpy)
    router_bias: Any  # [moe layers, experts]: part of the model's forward, not only of training
    metadata: dict[str, Any]  # the checkpoint's: config record, step, tokens, data position
    step: int
    path: str  # the checkpoint directory


def model_config_of(metadata: Mapping[str, Any]) -> Any:
    """The MoEConfig a checkpoint's run trained, from its metadata's config record."""
    from marin.models.config import MoEConfig  # kept off the light import path of CheckpointPolicy

    model = metadata["config"]["model"]
    if not isinstance(model, dict):
        raise ValueError(f"the checkpoint's config names model {model!r} without its fields; it predates recorded "
                         "model configs and cannot be loaded by itself")
    return from_jsonable(MoEConfig, model)


def load_model(run_path: str, mesh: Any = None, *, step: int | None = None,
               param_sharding: str = "replicated") -> LoadedModel:
    """Load a training run's model for inference: its config, params and router bias (no optimizer
    state), restored onto ``mesh`` whatever pool wrote it; each process reads only the slices its
    devices hold. ``step``: a committed checkpoint's step (default: the newest). ``param_sharding``:
    "replicated" or "fsdp" (marin.parallel.layout; expert weights are split over "expert" either
    way). ``mesh=None`` reads the model whole into this process as numpy arrays (export)."""
    import jax  # not at the top: review and planning read checkpoint records without JAX

    from marin.models.transformer import init_params, init_router_bias  # JAX only when a model is loaded

    step = checkpoint_step(run_path, step)
    path = checkpoint_path(run_path, step)
    meta = read_metadata(path)
    cfg = model_config_of(meta)
    template = {"params": jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0))),
                "router_bias": jax.eval_shape(lambda: init_router_bias(cfg))}
    shardings = None
    if mesh is not None:
        from marin.parallel.mesh import param_shardings, replicated  # JAX only when a mesh is given

        shardings = {"params": param_shardings(template["params"], mesh, param_sharding),
                     "router_bias": replicated(mesh)}
    tree, meta = restore_checkpoint(path, template, shardings, partial=True)
    return LoadedModel(cfg, tree["params"], tree["router_bias"], meta, step, path)


def read_full_state(run_path: str, *, step: int | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Every leaf of a run's checkpoint (optimizer state included), whole, as numpy arrays in this
    one process: ``({key path: array}, metadata)``. For an export the user asks for explicitly; a
    hero checkpoint is about 6.4 TB, so anything that runs on a pool uses :func:`load_model` or
    :func:`restore_checkpoint` with shardings instead."""
    return read_checkpoint(checkpoint_path(run_path, checkpoint_step(run_path, step)))
