"""The executor step functions for training: ``ExecutorStep(fn=train, config=TrainConfig(...))``, and
``gate`` (a paired gate of a live run, :func:`experiments.defaults.default_gate`).

The executor calls ``train(config)`` inside a Ray task with ``config.output_path`` resolved. The
function reserves the config's pool, runs one JAX process per host, and returns after the final
checkpoint is committed, so the executor writes SUCCESS only after that. A rerun of a step whose
earlier attempt died resumes from the latest committed checkpoint in the same output directory.
"""

from __future__ import annotations

from typing import Any

from marin.training.config import TrainConfig
from marin.training.gate import GateConfig


def train(config: TrainConfig) -> dict[str, Any]:
    """Run or resume the training described by ``config``; returns the run summary."""
    # Imported here so experiment files (and the executor's planner) never import JAX.
    from marin.training.trainer import run_training  # JAX: declaring a training step must not import it

    if not config.output_path:
        raise ValueError("TrainConfig.output_path is empty; use this_output_path() in the step config")
    return run_training(config)


def gate(config: GateConfig) -> dict[str, Any]:
    """Run (or resume) a paired gate's arms and write its ``gate.json`` (``default_gate``); returns the
    verdict."""
    from marin.training.gate_run import run_gate  # JAX: declaring a gate must not import it

    if not config.output_path:
        raise ValueError("GateConfig.output_path is empty; use this_output_path() in the step config")
    return run_gate(config)
