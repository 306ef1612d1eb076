"""The experiment API: steps and the placeholders their configs may hold.

An :class:`ExecutorStep` is a declaration, never a running thing: a name, a function, and a config.
Every value of the config is part of the step's identity (its hash) except a dataclass field declared
``live("why")`` (:mod:`marin.execution.versioning` states the rule). The config may hold three kinds
of placeholder, which the executor replaces before calling ``fn``:

* ``versioned(x)``, upstream Marin's spelling, marks ``x`` as part of the step's identity, as the rule
  already does: the version is the same as with a plain ``x``; unwrapped to ``x``.
* ``output_path_of(step, "sub")`` (an :class:`InputName`) depends on another step; replaced by that
  step's output path (plus ``/sub``). Its upstream's version is part of this step's hash.
* ``this_output_path("sub")`` (an :class:`OutputName`) is replaced by this step's own output path.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import re
import sys
from typing import Any, Callable, Generic, TypeVar

from marin.execution.hashing import HASH_CHARS

T = TypeVar("T")
ConfigT = TypeVar("ConfigT")

_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")

RESOURCE_KEYS = frozenset({"num_cpus", "num_gpus", "memory", "resources", "accelerator_type"})
"""Keys accepted in ``ExecutorStep.resources``; they map one-to-one onto Ray task options."""


NAME_PART_MAX = 255
"""Longest directory name most filesystems allow (NAME_MAX on Linux, macOS and Windows), in bytes; a
step name's parts are ASCII, so characters."""


class InvalidStepError(ValueError):
    """A step declaration is malformed (bad name, bad resources, bad override path)."""


@dataclasses.dataclass(frozen=True)
class VersionedValue(Generic[T]):
    """A config value that is part of the step's version; see :func:`versioned`."""

    value: T


def versioned(value: T) -> T:
    """Mark ``value`` as part of the step's identity: changing it changes the output path.

    Every config value not declared live already is; this is upstream Marin's explicit spelling, kept
    so its experiment files plan unchanged (``versioned(x)`` and ``x`` give the same version).

    Typed as returning ``T`` so configs keep their field types for type checkers; at run time the
    step's ``fn`` sees ``value`` itself.
    """
    return VersionedValue(value)  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class InputName:
    """A path inside another step's output directory.

    ``block_on_step=False`` (see :meth:`nonblocking`) still makes the upstream part of the hash and
    still runs it, but the dependent starts without waiting for it to finish: use it for things
    like "evaluate whichever checkpoint exists" where the reader copes with partial output.
    """

    step: "ExecutorStep"
    name: str | None = None
    block_on_step: bool = True

    def nonblocking(self) -> "InputName":
        return dataclasses.replace(self, block_on_step=False)

    def cd(self, name: str) -> "InputName":
        """A path below this one."""
        return dataclasses.replace(self, name=name if self.name is None else posixpath.join(self.name, name))


@dataclasses.dataclass(frozen=True)
class OutputName:
    """This step's own output path (plus an optional sub path); see :func:`this_output_path`."""

    name: str | None = None


def output_path_of(step: "ExecutorStep", subpath: str | None = None) -> str:
    """Placeholder for ``step``'s output path (plus ``subpath``); makes ``step`` a dependency."""
    if not isinstance(step, ExecutorStep):
        raise TypeError(
            f"output_path_of() needs an ExecutorStep, got {type(step).__name__} ({step!r:.80}); "
            "pass the step object returned by ExecutorStep(...) or a default_* builder"
        )
    return InputName(step, subpath)  # type: ignore[return-value]


def this_output_path(subpath: str | None = None) -> str:
    """Placeholder for the output path of the step whose config holds it."""
    return OutputName(subpath)  # type: ignore[return-value]


@dataclasses.dataclass(eq=False)
class ExecutorStep(Generic[ConfigT]):
    """One unit of work: ``fn(config)`` writing into ``{prefix}/{name}-{hash}``.

    ``resources`` are Ray task options for the step's task: ``num_cpus`` (default 1), ``num_gpus``,
    ``memory`` (bytes), ``accelerator_type``, ``resources`` (custom resources such as
    ``{"GB200": 4}``). ``override_output_path`` pins the output directory (relative paths are taken
    relative to the prefix; it must stay inside the prefix).

    How the executor treats the step under faults (neither is part of its version):
    ``infra_retries`` is how often it resubmits the step by itself after an infrastructure failure
    (a host or node lost, a preemption; see :mod:`marin.execution.failures`). None: never, unless
    ``--infra_retries`` says so; a step that resumes from its own checkpoints on a device pool
    (training, evaluation) sets its pool's. ``stop_grace_s`` is how long the step may take, once the
    driver got a stop signal, to save its work and stop (see :mod:`marin.execution.signals`); 0: it
    is stopped at once.
    """

    name: str
    fn: Callable[[ConfigT], Any]
    config: ConfigT
    description: str | None = None
    override_output_path: str | None = None
    resources: dict[str, Any] | None = None
    infra_retries: int | None = None
    stop_grace_s: float = 0.0

    def __post_init__(self) -> None:
        self.declared_at = declaration_site()
        """``file:line`` of the experiment file's line that declared this step (None outside a script):
        a refusal at planning names it, as one raised while the file is read does."""
        validate_step_name(self.name)
        if not callable(self.fn):
            raise InvalidStepError(f"step {self.name!r}: fn must be callable, got {type(self.fn).__name__}")
        if self.resources is not None:
            unknown = set(self.resources) - RESOURCE_KEYS
            if unknown:
                raise InvalidStepError(
                    f"step {self.name!r}: unknown resource keys {sorted(unknown)}; "
                    f"allowed: {sorted(RESOURCE_KEYS)}"
                )
        if self.infra_retries is not None and (isinstance(self.infra_retries, bool)
                                               or not isinstance(self.infra_retries, int) or self.infra_retries < 0):
            raise InvalidStepError(f"step {self.name!r}: infra_retries must be a count >= 0 or None, "
                                   f"got {self.infra_retries!r}")
        if not isinstance(self.stop_grace_s, (int, float)) or not self.stop_grace_s >= 0:
            raise InvalidStepError(f"step {self.name!r}: stop_grace_s must be seconds >= 0, got {self.stop_grace_s!r}")

    def cd(self, subpath: str) -> str:
        """Shorthand for ``output_path_of(self, subpath)``."""
        return output_path_of(self, subpath)

    def __repr__(self) -> str:
        return f"ExecutorStep(name={self.name!r}, fn={getattr(self.fn, '__qualname__', self.fn)!r})"


def script_path() -> str | None:
    """The experiment file this process runs as a script (``python FILE.py``, ``marin run FILE.py``):
    ``__main__`` is a file, not a module run with ``-m`` (pytest, ipykernel) nor ``-c`` or an
    interactive session; None otherwise."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return os.path.abspath(path) if path is not None and getattr(main, "__spec__", None) is None else None


def declaration_site() -> str | None:
    """``file:line`` of the innermost frame of the running experiment file (:func:`script_path`) on
    the stack: the line of the file that declared what is being built (directly or through a builder
    such as ``default_train``); None outside a script or when the file is not on the stack."""
    script = script_path()
    frame = sys._getframe(1) if script and script.endswith(".py") else None  # not the `marin` command itself
    while frame is not None:
        if frame.f_code.co_filename == script or os.path.abspath(frame.f_code.co_filename) == script:
            rel = os.path.relpath(script)
            return f"{script if rel.startswith('..') else rel}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def validate_step_name(name: str) -> None:
    """Step names become directory names: refuse anything that could escape the prefix."""
    if not isinstance(name, str) or not name:
        raise InvalidStepError(f"step name must be a non-empty string, got {name!r}")
    if name.startswith("/") or "://" in name:
        raise InvalidStepError(f"step name {name!r} is an absolute path; names are relative to the prefix")
    if ".." in name.split("/"):
        raise InvalidStepError(f"step name {name!r} contains '..', which would escape the prefix")
    if "." in name.split("/") or "" in name.split("/"):
        spelling = "/".join(p for p in name.split("/") if p not in ("", "."))
        raise InvalidStepError(
            f"step name {name!r} has an empty or '.' part; write it as {spelling!r}"
            " (each name has one spelling, so one step has one output directory)"
        )
    if not _NAME_RE.match(name):
        raise InvalidStepError(
            f"step name {name!r} has characters outside [A-Za-z0-9_.-] (with '/' between parts)"
        )
    parts = name.split("/")
    limit = NAME_PART_MAX - 1 - HASH_CHARS  # the last part becomes the directory "<part>-<hash>"
    long = [p for p in parts[:-1] if len(p) > NAME_PART_MAX] + ([parts[-1]] if len(parts[-1]) > limit else [])
    if long:
        short = long[0][:24] + "..."
        raise InvalidStepError(
            f"step name {short!r} has a part of {len(long[0])} characters; a part becomes a directory name, which "
            f"filesystems limit to {NAME_PART_MAX} bytes (the last part to {limit}, leaving room for '-' and the "
            "hash): shorten it, or split it into parts with '/'"
        )
