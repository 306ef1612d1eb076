"""Step leases: who may run a step right now, with fencing tokens.

``.executor_lease`` holds ``{holder, token, since, expiry, host, pid, released, abandoned, info}``.
A lease is acquired by a compare-and-swap on that file (see :mod:`storage` for the per-backend guarantee);
each acquisition increments ``token``, so a holder that was presumed dead and replaced can tell (its
token is no longer current) and must stop writing. The holder renews ``expiry`` by heartbeat.

A held lease is also the record of the attempt in progress: the step is RUNNING since ``since``,
and ``info`` says what it runs, without a status or info write (see :func:`status.read_status`),
so starting a step creates one file. A takeover of a lease whose holder died holding it keeps that
attempt in ``abandoned``, so the step's history still shows it.

A finished (SUCCESS) step has no lease file: inside :func:`fenced`, the holder writes SUCCESS with
``consume=lease_path(step_dir)`` (see :func:`status.write_status`), which removes the lease in the same
write. A finished step is never acquired again, so its token counter need not survive; an executor
waiting for it finds no lease, takes a fresh one, reads SUCCESS and reuses the step.

A lease is stale, and may be taken over, when it was released, when its expiry has passed, or when
its holder ran on this very host and its process no longer exists (so a crashed executor on a
laptop is replaced at once, not after the expiry).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import socket
import time
import uuid
from typing import Iterator

from marin.execution import storage
from marin.execution.errors import ExecutorError
from marin.execution.failures import disk_full_error
from marin.textfmt import format_bytes

LEASE_FILE = ".executor_lease"

DEFAULT_TTL_S = 20.0
"""Lease lifetime without a heartbeat. With heartbeats every TTL/4 and waiters polling about every
second, a dead holder on another host is replaced within TTL + poll (about 21 s) of its death."""


class LeaseLost(RuntimeError):
    """Our lease was taken over (we were presumed dead); stop writing to the step."""


class LeaseReleased(LeaseLost):
    """Our own lease was released (the step was finished or stopped by us): nothing more to renew."""


class LeaseWriteDiskFull(ExecutorError):
    """A step's lease could not be written because the disk is full: the step never started, so
    there is nothing of it to record (that write would fail the same way); the run ends in one line."""


Attempt = tuple[str, int, float]
"""One holder's attempt at a step: ``(holder, token, since)``."""


@dataclasses.dataclass(frozen=True)
class Lease:
    holder: str
    token: int
    expiry: float
    host: str
    pid: int
    released: bool = False
    since: float = 0.0
    """When this holder acquired the lease: the start of its attempt (renewals keep it)."""
    abandoned: tuple[Attempt, ...] = ()
    """Attempts of earlier holders that died holding the lease, oldest first (they may have no event
    in the status file: the lease was their only record)."""
    info: dict | None = dataclasses.field(default=None, compare=False)
    """What the step is, as this attempt runs it (config, version, lineage, code, host); the status
    record takes it over with the attempt's first write (see :func:`status.read_info`)."""

    @property
    def attempt(self) -> Attempt:
        return (self.holder, self.token, self.since)

    def to_json(self) -> str:
        # the fields as they are (dataclasses.asdict would deep-copy info first, for every write and renewal)
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return json.dumps(fields, sort_keys=True, default=repr)

    @staticmethod
    def from_json(text: str) -> "Lease":
        fields = json.loads(text)
        fields["abandoned"] = tuple(tuple(a) for a in fields.get("abandoned", ()))
        return Lease(**fields)


def new_holder_id() -> str:
    """Unique id of one executor process: ``host:pid:random``."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_stale(lease: Lease, now: float, this_host: str, pid_alive=_pid_alive) -> bool:
    """Whether ``lease`` may be taken over at time ``now`` by a process on ``this_host``."""
    if lease.released or now >= lease.expiry:
        return True
    return lease.host == this_host and not pid_alive(lease.pid)


def lease_path(step_dir: str) -> str:
    return f"{step_dir}/{LEASE_FILE}"


def read_lease(step_dir: str) -> Lease | None:
    text = storage.read_text(lease_path(step_dir))
    return Lease.from_json(text) if text else None


def try_acquire(step_dir: str, holder: str, ttl: float = DEFAULT_TTL_S, info: dict | None = None) -> Lease | None:
    """Take the step's lease if free or stale; None if a live holder has it (or we lost a race).

    ``info``: what the step is, for this attempt; written with the lease, so starting a step is
    one write."""
    path = lease_path(step_dir)
    text, tag = storage.read_with_tag(path)
    host = socket.gethostname()
    now = time.time()
    current = Lease.from_json(text) if text else None
    if current is not None and current.holder == holder and not current.released:
        return current  # re-entrant
    if current is not None and not is_stale(current, now, host):
        return None
    lease = Lease(
        holder=holder,
        token=(current.token + 1) if current else 1,
        expiry=now + ttl,
        host=host,
        pid=os.getpid(),
        since=now,
        abandoned=(current.abandoned + (current.attempt,)) if current and not current.released else (),
        info=info,
    )
    try:
        swapped = storage.compare_and_swap(path, lease.to_json(), tag)
    except OSError as e:
        if (full := disk_full_error(e)) is None:
            raise
        raise LeaseWriteDiskFull(f"cannot start {step_dir}: disk full: {full.strerror or os.strerror(full.errno)} "
                                 f"writing its lease ({_room(step_dir)}); free space and rerun") from None
    return lease if swapped else None


def _room(step_dir: str) -> str:
    """How much space the disk under ``step_dir`` has left, for a disk-full message."""
    try:
        usage = shutil.disk_usage(step_dir)
    except OSError:
        return "the disk's free space is unknown"
    return f"{format_bytes(usage.free)} free of {format_bytes(usage.total)} there"


def renew(step_dir: str, lease: Lease, ttl: float = DEFAULT_TTL_S) -> Lease:
    """Extend our lease; raises :class:`LeaseLost` if someone else holds the current token."""
    path = lease_path(step_dir)
    text, tag = storage.read_with_tag(path)
    current = Lease.from_json(text) if text else None
    _check_ours(step_dir, current, lease)
    new = dataclasses.replace(lease, expiry=time.time() + ttl)
    if not storage.compare_and_swap(path, new.to_json(), tag):
        if storage.read_text(path) == new.to_json():  # our PUT landed, then a retry of it lost to itself
            return new
        raise LeaseLost(f"lease on {step_dir} changed while renewing token {lease.token}")
    return new


def _check_ours(step_dir: str, current: Lease | None, lease: Lease) -> None:
    """Raise :class:`LeaseLost` unless ``current`` is ``lease``'s token, still held."""
    if current is not None and current.holder == lease.holder and current.token == lease.token:
        if current.released:
            raise LeaseReleased(f"lease on {step_dir} (token {lease.token}) was released")
        return
    other = f"{current.holder} (token {current.token})" if current else "nobody"
    raise LeaseLost(f"lease on {step_dir} now held by {other}; we had token {lease.token}")


@contextlib.contextmanager
def fenced(step_dir: str, lease: Lease) -> Iterator[Lease]:
    """Writes that only the current holder may make: check the token, write, and release if asked.

    Raises :class:`LeaseLost` (writing nothing) unless ``lease`` is still the step's current lease.
    On local disk the check and the writes inside run under the step directory's lock, which every
    lease compare-and-swap also takes, so a takeover cannot slip in between the check and the writes.
    Object stores have no such lock: the check is a read, and a takeover in the instant between it
    and the writes goes unnoticed, as with a renewal followed by a write.
    """
    with storage.step_lock(step_dir):
        text, _ = storage.read_with_tag(lease_path(step_dir))
        _check_ours(step_dir, Lease.from_json(text) if text else None, lease)
        yield lease


def release(step_dir: str, lease: Lease) -> None:
    """Give the lease up (keeping the token counter, so tokens stay monotonic). Never raises LeaseLost."""
    path = lease_path(step_dir)
    text, tag = storage.read_with_tag(path)
    if not text:
        return
    current = Lease.from_json(text)
    if current.holder != lease.holder or current.token != lease.token:
        return
    storage.compare_and_swap(path, dataclasses.replace(current, released=True, expiry=0.0).to_json(), tag)
