"""The leases one driver holds, and the heartbeat that keeps them.

Every step a driver has submitted (or is about to) holds its lease here. A heartbeat thread renews
each one every quarter of its lifetime; a lease lost to a takeover (another driver presumed this one
dead) is dropped and its step noted in :attr:`LeaseKeeper.lost`, so the driver cancels the step's
task and writes nothing more for it. The driver's loop and the heartbeat share :attr:`LeaseKeeper.lock`:
once the loop has taken a lease out (:meth:`LeaseKeeper.take`, to commit the step), the heartbeat leaves
it alone.
"""

from __future__ import annotations

import logging
import threading

from marin.execution import lease as leases
from marin.execution import storage
from marin.execution.plan import PlannedStep

logger = logging.getLogger("marin.execution")


class LeaseKeeper:
    """The leases held by one driver (``holder``), renewed every ``ttl / 4`` seconds while :meth:`running`."""

    def __init__(self, ttl: float, holder: str | None = None) -> None:
        self.ttl = ttl
        self.holder = holder or leases.new_holder_id()
        self.lock = threading.Lock()
        self.held: dict[PlannedStep, leases.Lease] = {}
        self.lost: dict[PlannedStep, str] = {}
        """Steps whose lease was taken over while held, with why (the step must write nothing more)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self, s: PlannedStep, info: dict | None = None) -> leases.Lease | None:
        """Take ``s``'s lease (carrying ``info``, what the step is) and hold it; None if a live driver has it."""
        lease = leases.try_acquire(s.output_path, self.holder, self.ttl, info=info)
        if lease is not None:
            self.hold(s, lease)
        return lease

    def hold(self, s: PlannedStep, lease: leases.Lease) -> None:
        with self.lock:
            self.held[s] = lease

    def get(self, s: PlannedStep) -> leases.Lease | None:
        with self.lock:
            return self.held.get(s)

    def holds(self, s: PlannedStep) -> bool:
        with self.lock:
            return s in self.held

    def take(self, s: PlannedStep) -> leases.Lease | None:
        """Stop renewing ``s``'s lease and hand it to the caller (to commit or release the step)."""
        with self.lock:
            return self.held.pop(s, None)

    def release(self, s: PlannedStep) -> leases.Lease | None:
        """Give ``s``'s lease up, if held; returns it."""
        lease = self.take(s)
        if lease is not None:
            leases.release(s.output_path, lease)
        return lease

    def items(self) -> list[tuple[PlannedStep, leases.Lease]]:
        with self.lock:
            return list(self.held.items())

    def lost_among(self, steps: object) -> list[PlannedStep]:
        """The steps of ``steps`` (a container) whose lease was lost."""
        with self.lock:
            return [s for s in self.lost if s in steps]

    def running(self) -> "LeaseKeeper":
        """Start the heartbeat; use as ``with keeper.running():`` (the block's end stops it and
        releases every lease still held)."""
        self._thread = threading.Thread(target=self._heartbeat, name="marin-lease-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __enter__(self) -> "LeaseKeeper":
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for s, _ in self.items():
            self.release(s)

    def _heartbeat(self) -> None:
        interval = max(0.05, self.ttl / 4)
        while not self._stop.wait(interval):
            for s, lease in self.items():
                self._renew(s, lease)

    def _renew(self, s: PlannedStep, lease: leases.Lease) -> None:
        try:
            with storage.sparing_reserve():  # a full disk's space is for the failure's record
                new = leases.renew(s.output_path, lease, self.ttl)
        except leases.LeaseReleased:  # the driver finished or stopped the step meanwhile
            with self.lock:
                if self.held.get(s) == lease:
                    del self.held[s]
            return
        except leases.LeaseLost as e:
            with self.lock:
                if self.held.get(s) != lease:  # the loop committed or stopped it meanwhile
                    return
                del self.held[s]
                self.lost[s] = f"lease lost while running, step stopped: {e}"
            logger.error("step %s: %s; stopping it", s.name, e)
            return
        except Exception as e:  # transient store error: try again next beat
            logger.warning("step %s: lease renewal failed (%s); will retry", s.name, e)
            return
        with self.lock:
            if s in self.held:
                self.held[s] = new
