"""Training: the JAX MoE trainer, its schedules, checkpoints and telemetry (the device pools it runs on
are :mod:`marin.pools`).

JAX-free entry points (safe to import from experiment files): ``config``, ``schedule``,
``checkpoint``, ``metrics``, ``steps``. ``trainer`` imports JAX.
"""

from marin.training.config import SyntheticDataConfig, TrainConfig

__all__ = ["SyntheticDataConfig", "TrainConfig"]
