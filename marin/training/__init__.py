"""Training: the JAX MoE trainer, its schedules, checkpoints, telemetry, and Ray device pools.

JAX-free entry points (safe to import from experiment files): ``config``, ``schedule``, ``pools``,
``checkpoint``, ``metrics``, ``steps``. ``trainer`` imports JAX.
"""

from marin.training.config import SyntheticDataConfig, TrainConfig

__all__ = ["SyntheticDataConfig", "TrainConfig"]
