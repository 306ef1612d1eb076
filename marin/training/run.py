"""A training run as its readers see it: one object for a training step's output directory.

Everything that looks at a finished or running run (the eval step, ``marin eval``, ``sample``,
``export``, ``harness``, ``health``, ``compare``, ``replan-lr``) opens it as a :class:`Run`: its
committed checkpoints, each one's metadata and config record, the config read back as the
:class:`~marin.training.config.TrainConfig` it trained, the step's executor record, its metrics,
and the model restored onto a mesh. Each part is read when first asked for and kept, so a reader
that needs only the config never lists arrays, and one that needs only the steps never reads a
record. A Run is a snapshot: a checkpoint committed after its steps were listed is not in them
(open the run again to see it).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import fsspec

from marin.execution.status import read_info
from marin.training.checkpoint.discovery import select_steps
from marin.training.checkpoint.format import read_metadata
from marin.training.checkpoint.loading import LoadedModel, load_model
from marin.training.checkpoint.manager import CheckpointManager, CheckpointPolicy
from marin.training.config import TrainConfig, train_config_from_record
from marin.training.metrics import read_metrics


@dataclasses.dataclass(frozen=True)
class Run:
    """The training run whose step output directory is ``directory`` (any fsspec path)."""

    directory: str
    _metadata: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict, init=False, repr=False,
                                                             compare=False)
    """Each checkpoint's metadata once read (a checkpoint never changes once committed)."""

    @property
    def exists(self) -> bool:
        """Whether the directory is there at all (a mistyped path has no checkpoints either)."""
        fs, path = fsspec.core.url_to_fs(self.directory)
        return bool(fs.exists(path))

    @functools.cached_property
    def _checkpoints(self) -> CheckpointManager:
        return CheckpointManager(self.directory, CheckpointPolicy())

    @functools.cached_property
    def committed_steps(self) -> list[int]:
        """Steps of the run's committed (permanent) checkpoints, ascending; a half-written one is
        never listed."""
        return self._checkpoints.committed_steps()

    @property
    def latest_step(self) -> int | None:
        """The newest committed checkpoint's step, None before the first."""
        return self.committed_steps[-1] if self.committed_steps else None

    def checkpoint_path(self, step: int) -> str:
        """The directory of the run's checkpoint at ``step``."""
        return self._checkpoints.permanent.url(step)  # no listing: a reader has only the permanent tier

    def select(self, checkpoint: str | int | None = "latest") -> list[int]:
        """The committed steps ``checkpoint`` names, ascending: "latest" (or None) the newest, "all"
        every retained one, or a step number; FileNotFoundError saying what is there otherwise."""
        return select_steps(self.directory, checkpoint, steps=self.committed_steps)

    def step(self, step: int | None = None) -> int:
        """``step`` if it is committed, else (None) the newest; FileNotFoundError otherwise."""
        return self.select(step)[0]

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The metadata of the checkpoint at ``step`` (None: the newest): its config record, tokens
        seen, data position, sequence length and transport."""
        step = self.step(step)
        if step not in self._metadata:
            self._metadata[step] = read_metadata(self.checkpoint_path(step))
        return self._metadata[step]

    def record(self, step: int | None = None) -> dict[str, Any]:
        """The training config as the checkpoint at ``step`` (None: the newest) recorded it: JSON,
        secrets masked (what ``marin show`` prints)."""
        return self.metadata(step).get("config") or {}

    def config(self, step: int | None = None) -> TrainConfig:
        """The :class:`TrainConfig` that wrote the checkpoint at ``step`` (None: the newest), read back
        from its record: exactly the model, schedule and data the run trained."""
        return train_config_from_record(self.record(step))

    @functools.cached_property
    def info(self) -> dict[str, Any] | None:
        """What the executor recorded of the step (config, version, code, host), None for a run
        started without the executor or not started yet."""
        try:
            return read_info(self.directory.rstrip("/"))
        except (OSError, ValueError):  # an unreadable or absent record: the checkpoints still tell
            return None

    @functools.cached_property
    def recorded_config(self) -> dict[str, Any] | None:
        """The run's config record: the step's executor record (its latest attempt) when there is
        one, else the newest checkpoint's; None before either exists."""
        config = (self.info or {}).get("config")
        if config:
            return config
        return self.record() if self.committed_steps else None

    def metrics(self, kind: str | None = "train") -> list[dict[str, Any]]:
        """The run's ``metrics.jsonl`` records of ``kind`` ("train", "eval"; None: all), in order."""
        return read_metrics(self.directory, kind)

    def load(self, step: int | None = None, mesh: Any = None, *, param_sharding: str = "replicated") -> LoadedModel:
        """The model at committed checkpoint ``step`` (None: the newest), restored onto ``mesh``
        whatever pool wrote it, each process reading only its devices' slices; ``mesh=None`` reads
        it whole into this process as numpy arrays. See :func:`marin.training.checkpoint.load_model`."""
        return load_model(self.directory, mesh, step=self.step(step), param_sharding=param_sharding)
