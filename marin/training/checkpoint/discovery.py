"""A run's committed checkpoints: which steps, where each one is, and the ones a reader names
("latest", "all", a step).
"""

from __future__ import annotations

from marin.training.checkpoint.manager import CheckpointManager, CheckpointPolicy


def latest_checkpoint(output_path: str) -> str | None:
    """Path of the newest committed checkpoint of a training step's output directory, or None."""
    mgr = CheckpointManager(output_path, CheckpointPolicy())
    step = mgr.latest_step()
    return None if step is None else mgr.path_for(step)


def committed_steps(run_path: str) -> list[int]:
    """Steps of the committed checkpoints of the training run at ``run_path``, ascending (half-written
    ones are never listed)."""
    return CheckpointManager(run_path, CheckpointPolicy()).committed_steps()


def checkpoint_path(run_path: str, step: int) -> str:
    """The directory of the run's checkpoint at ``step``."""
    return CheckpointManager(run_path, CheckpointPolicy()).path_for(step)


def select_steps(run_path: str, checkpoint: str | int | None = "latest", *,
                 steps: list[int] | None = None) -> list[int]:
    """The committed checkpoints of the run at ``run_path`` that ``checkpoint`` names, ascending:
    "latest" (or None) the newest, "all" every retained one, or a step number; FileNotFoundError
    saying what is there when the run has none, or none at that step. ``steps``: the run's committed
    steps when the caller has listed them already."""
    steps = committed_steps(run_path) if steps is None else steps
    if not steps:
        raise FileNotFoundError(f"{run_path} has no committed checkpoint (is it a training step's output directory?)")
    if checkpoint is None or checkpoint == "latest":
        return steps[-1:]
    if checkpoint == "all":
        return steps
    try:
        step = int(checkpoint)
    except (TypeError, ValueError):
        raise ValueError(f"checkpoint must be 'latest', 'all' or a step number, got {checkpoint!r}") from None
    if step not in steps:
        raise FileNotFoundError(f"{run_path} has no committed checkpoint at step {step}; committed: {steps}")
    return [step]


def checkpoint_step(run_path: str, step: int | None = None) -> int:
    """``step`` if the run at ``run_path`` has a committed checkpoint there, else (None) its newest;
    FileNotFoundError saying what is there otherwise."""
    return select_steps(run_path, step)[0]
