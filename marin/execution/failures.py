"""Which step failures are the infrastructure's and which are the step's own.

At the scale of a 176-host pool a lost host, a preempted node or a storage outage is a daily event;
none of them says anything about the step, and the step resumes from its last checkpoint, so the
executor retries them by itself (a bounded number of times, with backoff, each attempt recorded).
A divergence, a config error or a bug fails the same way every time: those fail at once, for a
person to look at. Anything not known to be the infrastructure's counts as the step's own.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Iterator

from marin.execution.retry import StorageUnavailable


class InfrastructureFailure(RuntimeError):
    """The machinery under a step failed (a host, worker or node died, the step was preempted, a
    store stayed down past its retry limit); raise it (or a subclass) for a failure a retry from the
    last checkpoint can fix."""


class Preempted(InfrastructureFailure):
    """The step's process was told to stop (SIGTERM from a scheduler) and stopped cleanly, after
    saving what it could (a training host writes a final checkpoint when its grace period allows)."""


class StopRequested(Preempted):
    """The step stopped because the driver asked it to (a stop signal reached ``marin run``; see
    :func:`marin.execution.signals.request_stop`), after saving what it could. The run is ending, so
    neither a pool's launcher nor the executor retries it; the next run resumes it."""


class InputNotSucceeded(RuntimeError):
    """A step's input was not SUCCESS when the step's task started (another driver reran it, or its
    record was changed by hand): the step refuses to read it. Neither the step's own failure nor the
    infrastructure's: the step is recorded DEP_FAILED, which the next run starts again by itself."""


_RAY_INFRASTRUCTURE = frozenset({
    "WorkerCrashedError", "NodeDiedError", "ActorDiedError", "ActorUnavailableError", "OwnerDiedError",
    "ObjectLostError", "ObjectFetchTimedOutError", "ObjectReconstructionFailedError", "LocalRayletDiedError",
    "RaySystemError", "OutOfDiskError",
})
"""Ray's errors for a process, node or object lost underneath a task (matched by name: this layer
does not import Ray)."""

_PEER_LOST_WORDS = ("unavailable:", "deadline_exceeded", "connection reset by peer", "connection refused",
                    "socket closed", "gloo", "heartbeat timeout")
"""What XLA's collectives say when another host of the pool went away mid-step."""

_XLA_RUNTIME_ERRORS = frozenset({"XlaRuntimeError", "JaxRuntimeError"})
"""The runtime error of a failed XLA computation, by its names: ``XlaRuntimeError`` in older jax
releases, ``jax.errors.JaxRuntimeError`` in the pinned one."""


def error_chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and every exception behind it: ``__cause__``, ``__context__`` and a Ray task error's
    ``cause`` (the step's own exception, as the driver sees it), each once."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        cause = getattr(e, "cause", None)  # a Ray task error carries the step's exception here
        stack += [cause if isinstance(cause, BaseException) else None, e.__cause__, e.__context__]


def is_infrastructure_failure(exc: BaseException | None) -> bool:
    """Whether ``exc`` (a step's error as the driver sees it, Ray's wrapper included) is the
    infrastructure's: one of the errors above anywhere in its chain or as a Ray task's cause."""
    for e in error_chain(exc):
        if isinstance(e, (InfrastructureFailure, StorageUnavailable)):
            return True
        names = {c.__name__ for c in type(e).__mro__}
        if names & _RAY_INFRASTRUCTURE:
            return True
        if names & _XLA_RUNTIME_ERRORS and any(w in str(e).lower() for w in _PEER_LOST_WORDS):
            return True
    return False


_NODE_MEMORY = re.compile(r"Memory on the node \(IP: ([^,)]+)[^)]*\) was ([\d.]+\s*GB used / [\d.]+\s*GB limit)")


def host_memory_error(exc: BaseException | None) -> str | None:
    """Where Ray's memory monitor killed a worker of ``exc``'s chain because its node ran low on host
    memory (``ray.exceptions.OutOfMemoryError``, matched by name), as "node IP: X GB used / Y GB
    limit" (or the error's first line), else None. Not an infrastructure failure: the same program on
    the same nodes needs the same memory, so a retry fails the same way."""
    for e in error_chain(exc):
        if "OutOfMemoryError" in {c.__name__ for c in type(e).__mro__}:
            found = _NODE_MEMORY.search(str(e))
            return f"node {found[1]}: {found[2]}" if found else (str(e).strip().splitlines() or [""])[0][:300]
    return None


DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def disk_full_error(exc: BaseException | None) -> OSError | None:
    """The "no space left" (or "quota exceeded") error in ``exc``'s chain, Ray's wrapper included, or
    None. Not an infrastructure failure: a retry fails the same way until someone frees space."""
    return next((e for e in error_chain(exc) if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS), None)


_STORE_CLIENT_MODULES = ("botocore", "aiobotocore", "s3fs", "gcsfs", "google.auth", "google.api_core",
                         "google.cloud", "aiohttp", "requests", "urllib3")
"""Where the object-store clients' own errors come from (matched by module: this layer imports none)."""

STORE_ADVICE = "check the prefix, your credentials and the network"


def store_access_error(exc: BaseException | None) -> BaseException | None:
    """The error in ``exc``'s chain that says an object store could not be read (credentials missing
    or refused, access denied, an endpoint that does not answer, the retry limit spent), or None for
    anything else: a bug, or a local file's error, keeps its own report."""
    for e in error_chain(exc):
        if isinstance(e, StorageUnavailable):
            return e
        if any(c.__module__.split(".")[0] in _STORE_CLIENT_MODULES or c.__module__.startswith(_STORE_CLIENT_MODULES)
               for c in type(e).__mro__ if c.__module__ != "builtins"):
            return e
    return None


def unreadable_store_message(where: str, exc: BaseException) -> str:
    """``cannot read step status under s3://b/x: NoCredentialsError: Unable to locate credentials``:
    one line (the error's first), whoever reads the store: ``marin run`` and the review commands."""
    text = str(exc).strip()
    line = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")
    return f"cannot read {where}: {line if len(line) <= 300 else line[:297] + '...'}"
