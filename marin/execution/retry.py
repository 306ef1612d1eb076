"""The one retry policy for transient object-store errors: bounded exponential backoff, a time limit.

Object stores drop connections, refuse them for a moment while a frontend restarts, and answer
503 "slow down" under load. On a run of months these hiccups are daily; none of them is a reason to
fail a step. Every layer that writes to a store (executor records, leases, training metrics,
checkpoints) goes through :func:`call_with_retry` or, where it must not block (a training loop
that buffers its metrics), through an :class:`Outage` it keeps itself. Both apply one
:class:`RetryPolicy`: each failed attempt waits ``first_delay_s * 2**n`` (capped at
``max_delay_s``), and once ``limit_s`` seconds have passed since the outage began, the operation
fails with :class:`StorageUnavailable`, whose message names the operation, the time waited and the
store's own last error.

Only errors that say "the store could not be reached or answered 5xx" are retried; a missing file, a
permission error or a full disk fail at once (waiting does not fix them). Inside
:func:`refusal_fails_fast` (the commands a person waits on), a connection refused before any store
call of the block has succeeded fails at once too: nothing listens at that endpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

logger = logging.getLogger("marin.execution.retry")

T = TypeVar("T")

LIMIT_ENV = "MARIN_STORAGE_RETRY_S"
"""Environment variable overriding :attr:`RetryPolicy.limit_s` (seconds), inherited by Ray workers."""


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How long and how often a transient storage error is retried."""

    first_delay_s: float = 0.5
    max_delay_s: float = 10.0
    limit_s: float = 300.0
    """Seconds from the first failure of an outage until it counts as a real failure. Five minutes
    covers a frontend restart or a network blip; anything longer needs a person (the step fails
    with the cause recorded, and the executor retries it as an infrastructure failure)."""

    def delay(self, attempt: int) -> float:
        """Seconds to wait after the ``attempt``-th consecutive failure (1-based)."""
        return min(self.max_delay_s, self.first_delay_s * 2 ** max(0, attempt - 1))


_local = threading.local()


def default_policy() -> RetryPolicy:
    """The policy in force: :class:`RetryPolicy` defaults, ``limit_s`` from ``$MARIN_STORAGE_RETRY_S``,
    at most the cap of an enclosing :func:`capped` in this thread."""
    value = os.environ.get(LIMIT_ENV)
    limit = RetryPolicy.limit_s
    if value:
        try:
            limit = float(value)
        except ValueError:
            raise ValueError(f"${LIMIT_ENV}={value!r} is not a number of seconds") from None
    cap = getattr(_local, "cap", None)
    if cap is not None:
        limit = min(limit, cap)
    if limit == RetryPolicy.limit_s:
        return RetryPolicy()
    return RetryPolicy(limit_s=limit, max_delay_s=min(RetryPolicy.max_delay_s, max(limit / 4, 0.05)))


@contextlib.contextmanager
def capped(limit_s: float) -> Iterator[None]:
    """Retry for at most ``limit_s`` seconds inside this block (this thread): for bookkeeping that must
    not hold a person up, such as recording an interruption while the user waits for the prompt."""
    previous = getattr(_local, "cap", None)
    _local.cap = limit_s if previous is None else min(previous, limit_s)
    try:
        yield
    finally:
        _local.cap = previous


class _Refusal:
    """Whether a refused connection fails at once (inside :func:`refusal_fails_fast`, until a store
    call succeeds). Process-wide, not per thread: a command reads records from a pool of threads."""

    fail_fast = False
    reached = False


@contextlib.contextmanager
def refusal_fails_fast() -> Iterator[None]:
    """In this block, a connection the store refuses before any store call of the block succeeded is
    not transient: nothing listens at that endpoint (a wrong ``AWS_ENDPOINT_URL``, a store not
    started), and the retry limit (botocore retrying each attempt on top) would only make a person
    wait five minutes for the same one line. Once a call succeeded the endpoint is known to be
    there, and a refusal is a frontend restarting: ridden out as everywhere else."""
    previous = (_Refusal.fail_fast, _Refusal.reached)
    _Refusal.fail_fast, _Refusal.reached = True, False
    try:
        yield
    finally:
        _Refusal.fail_fast, _Refusal.reached = previous


def _refused(exc: BaseException) -> bool:
    """Whether the connection was refused (``ECONNREFUSED`` somewhere in ``exc``'s chain)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ConnectionRefusedError) or isinstance(exc, OSError) and exc.errno == errno.ECONNREFUSED:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class StorageUnavailable(OSError):
    """A store stayed unreachable for longer than the retry policy's limit (the cause is chained)."""


_TRANSIENT_NAMES = frozenset({
    # botocore / aiobotocore (s3fs)
    "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
    "ProxyConnectionError",
    # aiohttp (s3fs, gcsfs)
    "ClientConnectorError", "ServerDisconnectedError", "ClientOSError", "ServerTimeoutError",
    "ClientPayloadError",
    # requests / urllib3
    "ConnectTimeout", "ReadTimeout", "ProtocolError", "NewConnectionError",
})
_TRANSIENT_ERRNOS = frozenset({
    errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EHOSTUNREACH,
    errno.ENETUNREACH, errno.ENETDOWN, errno.EPIPE,
})
_TRANSIENT_WORDS = ("503", "service unavailable", "slowdown", "slow down", "internalerror",
                    "requesttimeout", "500 internal", "502 bad gateway", "504 gateway")
_CURL_CODE = re.compile(r"curl_code='?(\d+)")
_TRANSIENT_CURL_CODES = frozenset({
    7,   # could not connect
    16, 92,  # HTTP/2 framing or stream error
    18,  # transfer closed with data outstanding
    28,  # timed out
    52,  # empty reply from server
    55, 56,  # send / receive failed (connection reset)
})
"""libcurl's codes for "the connection failed", as tensorstore reports them: it raises ValueError for
every storage error, with the store's status and curl's code in the message
(``ABORTED: Error writing "k": All 3 retry attempts failed: CURL error Could not connect to server:
... [curl_code='7']``)."""
_TENSORSTORE_TRANSIENT = ("unavailable: ", "deadline_exceeded: ")
"""tensorstore status codes (the message's first word) for a store that did not answer in time."""


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) says the store was briefly unreachable."""
    if _Refusal.fail_fast and not _Refusal.reached and _refused(exc):
        return False
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, StorageUnavailable):
            return False  # already retried to its limit
        if isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError,
                            NotADirectoryError)):
            return False
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return True
        if any(c.__name__ in _TRANSIENT_NAMES for c in type(exc).__mro__):
            return True
        if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
            return True
        text = str(exc).lower()
        if any(w in text for w in _TRANSIENT_WORDS) or text.startswith(_TENSORSTORE_TRANSIENT):
            return True
        if (code := _CURL_CODE.search(text)) and int(code.group(1)) in _TRANSIENT_CURL_CODES:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


_TENSORSTORE_SPEC = re.compile(r"\s*\[tensorstore_spec='[^']*'\]")
"""The spec tensorstore appends to an error (kilobytes of JSON): not the cause, left out of messages."""


def _describe(exc: BaseException) -> str:
    """One line of at most about 300 characters; a longer one keeps its start (what failed) and its
    end, where libraries that nest their errors (tensorstore, curl) put the cause."""
    text = _TENSORSTORE_SPEC.sub("", str(exc)).strip()
    line = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
    return line if len(line) <= 300 else f"{line[:140]} ... {line[-155:]}"


class Outage:
    """One operation's run of consecutive transient failures, for callers that must not block.

    ``failed(exc)`` returns how long to wait before the next try, or raises: ``exc`` itself when it
    is not transient, :class:`StorageUnavailable` once the outage is older than the limit.
    ``succeeded()`` ends the outage (logging how long it lasted)."""

    def __init__(self, what: str, policy: RetryPolicy | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.what = what
        self.policy = policy or default_policy()
        self.clock = clock or (lambda: time.monotonic())
        self.since: float | None = None
        self.attempts = 0

    @property
    def active(self) -> bool:
        return self.since is not None

    def failed(self, exc: BaseException, began: float | None = None) -> float:
        """``began``: when the failed attempt started, on :attr:`clock`. A store client retries on its
        own before it raises (botocore takes about 5 s over a refused connection), so an outage counts
        from the start of its first failed attempt, not from when that attempt gave up: the limit holds
        and the "succeeded again after" line gives the outage's length."""
        if not is_transient(exc):
            raise exc
        now = self.clock()
        if self.since is None:
            self.since = now if began is None else min(began, now)
        self.attempts += 1
        waited = now - self.since
        if waited >= self.policy.limit_s:
            raise StorageUnavailable(
                f"{self.what}: the store stayed unreachable for {waited:.0f}s over {self.attempts} attempts "
                f"(retry limit {self.policy.limit_s:.0f}s, ${LIMIT_ENV}); last error: {_describe(exc)}"
            ) from exc
        delay = min(self.policy.delay(self.attempts), max(0.0, self.policy.limit_s - waited))
        logger.warning("%s failed (%s); attempt %d, retrying in %.1fs (giving up %.0fs after the first failure)",
                       self.what, _describe(exc), self.attempts, delay, self.policy.limit_s)
        return delay

    def succeeded(self) -> None:
        _Refusal.reached = True
        if self.since is not None:
            logger.warning("%s succeeded again after %.1fs and %d failed attempts", self.what,
                           self.clock() - self.since, self.attempts)
        self.since, self.attempts = None, 0

    def remaining_s(self) -> float:
        """Seconds left before the limit (the whole limit when no outage is under way)."""
        if self.since is None:
            return self.policy.limit_s
        return max(0.0, self.policy.limit_s - (self.clock() - self.since))


def call_with_retry(fn: Callable[[], T], *, what: str, policy: RetryPolicy | None = None,
                    sleep: Callable[[float], None] = time.sleep) -> T:
    """``fn()``, retried through transient storage errors under ``policy`` (default :func:`default_policy`).

    ``what`` names the operation in logs and in the final error (``"write s3://b/x/.executor_status"``).
    Non-transient errors propagate at once; an outage past the limit raises :class:`StorageUnavailable`
    from the store's last error. ``fn`` must be safe to repeat (whole-object writes and reads are)."""
    outage = Outage(what, policy)
    while True:
        began = outage.clock()
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - classified by is_transient; others re-raised by failed()
            sleep(outage.failed(e, began=began))
            continue
        outage.succeeded()
        return result
