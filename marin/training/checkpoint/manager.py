"""The checkpoint manager of a training run: when to save and what to keep (:class:`CheckpointPolicy`),
one asynchronous save in flight, retention, the rolling temporary tier, and resume from the newest
checkpoint that verifies.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import fsspec

from marin.execution.failures import InfrastructureFailure
from marin.execution.fieldcheck import check_fields, check_number
from marin.execution.versioning import live
from marin.textfmt import parse_bytes
from marin.training.checkpoint.format import (
    CHECKPOINT_DIR,
    PART_TIMEOUT_S,
    PERMANENT,
    TEMPORARY,
    CheckpointMismatchError,
    CheckpointWriteError,
    CorruptCheckpointError,
    TierStore,
    delete_dir,
    one_line,
    process_and_count,
)
from marin.training.checkpoint.restore import restore_checkpoint
from marin.training.checkpoint.save import Staged, stage, write_staged

logger = logging.getLogger(__name__)


class SavesFailing(CheckpointWriteError, InfrastructureFailure):
    """Permanent saves kept failing past the policy's limit (``checkpoint.max_failed_saves`` in a row,
    or ``checkpoint.max_minutes_without_commit``): the attempt ends as an infrastructure failure and
    is retried from the newest committed checkpoint."""


@dataclasses.dataclass(frozen=True)
class CheckpointPolicy:
    """When to save and what to keep.

    Saves happen every ``every_steps`` steps and additionally whenever ``every_minutes`` of wall time
    passed since the last save (so a slow run still loses little work). The newest ``keep_last``
    checkpoints are kept; checkpoints at multiples of ``keep_every`` are permanent (for evaluation and
    for branching, e.g. the early-cooldown side branch). The final step is always saved.

    The second tier: with ``temp_every_minutes`` (and a temporary store given to the manager), a
    rolling temporary checkpoint is written whenever that much wall time passed since the last save of
    either tier. One is kept; it is deleted once a newer permanent one commits. This is how the
    published hero run checkpoints: permanent ones to the durable root, sparse, and a temporary one
    every hour to region-local storage, so a fault costs at most an hour
    (marin-community/marin, ``experiments/grug/moe_hero_ep/README.md``).

    ``temp_path`` is where a training run's temporary store is (the trainer hands it to the manager);
    ``preemption_grace_s`` the seconds between a scheduler's SIGTERM and its SIGKILL, used for a
    final checkpoint (:mod:`marin.training.preemption`). As ``TrainConfig.checkpoint`` every field
    is live: when state is saved and what is kept, not what is computed.
    """

    every_steps: int = live("when state is saved, not what is computed", default=100)
    every_minutes: float | None = live("when state is saved, not what is computed", default=30.0)
    keep_last: int = live("which checkpoints are kept, not what is computed", default=2)
    keep_every: int | None = live("which checkpoints are kept, not what is computed", default=None)
    temp_every_minutes: float | None = live(
        "when state is saved, not what is computed: a rolling temporary checkpoint every this many minutes of "
        "wall time (None: none), so a fault costs at most this long while permanent checkpoints stay sparse",
        default=None)
    temp_path: str | None = live(
        "where the temporary checkpoint goes (a fast local or region-local prefix; the run writes under "
        "<prefix>/<run directory name>-<hash of its output path>/checkpoints, one kept), not what is computed: "
        "a run may move to another region and resume from its permanent checkpoints", default=None)
    max_failed_saves: int = live(
        "how many permanent saves in a row may fail (the store refused a write, a host's part did not arrive, "
        "the commit could not be written) before the attempt ends as an infrastructure failure and is retried "
        "from the newest committed checkpoint; until then training goes on and the next save point tries again. "
        "How failures are handled, not what is computed", default=3)
    max_minutes_without_commit: float | None = live(
        "with a failed save: end the attempt (an infrastructure failure) once the newest committed checkpoint "
        "is older than this many minutes of wall time, however few saves failed (None: no such limit). How "
        "failures are handled, not what is computed", default=None)
    pinned_steps: tuple[int, ...] = live(
        "checkpoints retention never deletes (a handoff or a branch's source that a person names); which are "
        "kept, not what is computed", default=())
    storage_quota: str | None = live(
        "the permanent store's quota for this run's checkpoints (\"100TiB\", \"250TB\"): a policy whose "
        "checkpoints would exceed it at their peak is refused before launch (marin plan shows the storage). "
        "What is kept, not what is computed", default=None)
    preemption_grace_s: float = live(
        "seconds between the scheduler's SIGTERM and its SIGKILL (Kubernetes: terminationGracePeriodSeconds); "
        "> 0: a SIGTERM ends training at the next step with a final checkpoint where the grace allows "
        "(marin.training.preemption); 0 leaves SIGTERM alone (tiny runs). When state is saved, not what is "
        "computed", default=0.0)

    def __post_init__(self) -> None:
        check_fields(self, "checkpoint.", {
            "every_steps": "> 0", "every_minutes": "> 0", "keep_last": ">= 1", "keep_every": "> 0",
            "temp_every_minutes": "> 0", "max_failed_saves": ">= 1", "max_minutes_without_commit": "> 0",
            "preemption_grace_s": ">= 0"})
        if not isinstance(self.pinned_steps, (tuple, list)):
            raise ValueError(f"checkpoint.pinned_steps must be a tuple of steps, got {self.pinned_steps!r}")
        for i, step in enumerate(self.pinned_steps):
            check_number(f"checkpoint.pinned_steps[{i}]", step, int, "> 0")
        if self.storage_quota is not None:
            parse_bytes(self.storage_quota)  # a bad size is refused where the config is built

    def retention(self, committed: Iterable[int], pins: Mapping[int, Sequence[str]] | None = None,
                  current: int | None = None) -> dict[int, str]:
        """The retention rule, the one the manager deletes by and the storage plan counts by:
        ``{step: "keep: why" or "delete: why"}`` for each committed checkpoint. Kept: a pinned one
        (``pins``, by whom, and ``pinned_steps``), a multiple of ``keep_every`` (permanent), the newest
        ``keep_last`` and ``current`` (the save being made); the others are deleted."""
        pins = {**{int(s): ["checkpoint.pinned_steps"] for s in self.pinned_steps}, **(pins or {})}
        committed = sorted({int(s) for s in committed})
        newest = set(committed[-self.keep_last:])
        out = {}
        for s in committed:
            if s in pins:
                out[s] = "keep: pinned by " + ", ".join(pins[s])
            elif self.keep_every and s % self.keep_every == 0:
                out[s] = f"keep: permanent (checkpoint.keep_every={self.keep_every:,})"
            elif s in newest or s == current:
                out[s] = f"keep: newest {self.keep_last} (checkpoint.keep_last)"
            else:
                out[s] = "delete: older than the newest kept"
        return out

    def retained(self, committed: Iterable[int], pins: Iterable[int] = ()) -> set[int]:
        """The checkpoints :meth:`retention` keeps of ``committed`` (``pins``: steps pinned besides
        ``pinned_steps``)."""
        plan = self.retention(committed, {int(p): ["a pin"] for p in pins})
        return {s for s, action in plan.items() if action.startswith("keep")}


def temp_checkpoint_root(temp_prefix: str, output_path: str) -> str:
    """Where a run's temporary checkpoints go under the fast store ``temp_prefix``: a directory named
    after the run's own (its step name and version hash) plus a hash of its whole output path, so two
    runs of the same step under different prefixes never share (or delete) each other's."""
    run_dir = output_path.rstrip("/").rsplit("/", 1)[-1]
    where = hashlib.sha256(output_path.rstrip("/").encode()).hexdigest()[:8]
    return f"{temp_prefix.rstrip('/')}/{run_dir}-{where}/{CHECKPOINT_DIR}"


PINS_DIR = "pins"
"""Under a run's ``checkpoints/``: one JSON file per pin another step holds on one of its checkpoints."""


def _pin_file(run_path: str, step: int, by: str) -> tuple[Any, str, str]:
    """``(filesystem, pins directory, file name)`` of the pin ``by`` holds on ``run_path``'s ``step``."""
    fs, root = fsspec.core.url_to_fs(f"{run_path.rstrip('/')}/{CHECKPOINT_DIR}/{PINS_DIR}")
    return fs, root, hashlib.sha256(f"{by}@{step}".encode()).hexdigest()[:16] + ".json"


def pin_checkpoint(run_path: str, step: int, by: str, *, role: str = "branch") -> str:
    """Pin ``run_path``'s checkpoint at ``step`` for ``by`` (the output path of a step that depends on
    it: a branch's source, a gate while its arms train; ``role`` names which in ``marin checkpoints``):
    the run's retention never deletes it while the pin is there. Idempotent; returns the pin's file."""
    fs, root, name = _pin_file(run_path, step, by)
    fs.makedirs(root, exist_ok=True)
    fs.pipe_file(f"{root}/{name}", json.dumps({"step": int(step), "by": by, "role": role,
                                               "time": time.time()}).encode())
    return f"{root}/{name}"


def unpin_checkpoint(run_path: str, step: int, by: str) -> bool:
    """Release the pin ``by`` holds on ``run_path``'s checkpoint at ``step`` (:func:`pin_checkpoint`);
    the pins others hold on it stay. Idempotent: returns whether there was one to release."""
    fs, root, name = _pin_file(run_path, step, by)
    if not fs.exists(f"{root}/{name}"):
        return False
    fs.rm_file(f"{root}/{name}")
    return True


def read_pins(run_path: str) -> dict[int, list[str]]:
    """``{step: [who pinned it]}`` from the pin files under ``run_path``'s checkpoints (an unreadable
    one is skipped with a warning: it must not stop retention, and its checkpoint may then go)."""
    fs, root = fsspec.core.url_to_fs(f"{run_path.rstrip('/')}/{CHECKPOINT_DIR}/{PINS_DIR}")
    pins: dict[int, list[str]] = {}
    if not fs.exists(root):
        return pins
    for path in sorted(fs.ls(root, detail=False)):
        try:
            pin = json.loads(fs.cat_file(path))
            pins.setdefault(int(pin["step"]), []).append(f"{pin.get('role', 'branch')} {pin['by']}")
        except Exception as e:  # noqa: BLE001 - a damaged pin file: say so, keep going
            logger.warning("unreadable checkpoint pin %s: %s", path, one_line(e))
    return pins


class CheckpointManager:
    """Periodic asynchronous saves, retention and discovery of checkpoints under
    ``{output_path}/checkpoints`` and, with ``temp_path``, of the rolling temporary checkpoint under
    :func:`temp_checkpoint_root` of that fast store.

    Every process of a pool creates one and calls :meth:`save` at the same steps; each writes its own
    shards. Process 0 (``is_writer``) writes the index and COMMIT and applies retention. At most one
    save is in flight: :meth:`save` waits for the previous one first, and :meth:`wait` (called at the
    end of a run) for the last.

    A failed save costs minutes, never the job: a permanent save that fails (its error names the
    objects or the hosts' parts that failed and why) is logged in one line, counted
    (:attr:`failed_saves`, :attr:`failed_in_a_row`) and left uncommitted (the next successful save's
    retention removes what it wrote); training goes on and the next save point tries again. Only the
    ``max_failed_saves``-th failure in a row, or a failure once the newest commit is older than
    ``max_minutes_without_commit``, surfaces as :class:`SavesFailing` (an infrastructure failure: the
    attempt is retried from the newest committed checkpoint) from the next :meth:`save`, :meth:`check`
    or :meth:`wait`. Every process of a pool counts the same failures: a save's outcome is process 0's
    one verdict (COMMIT, or ABORT when a part did not arrive within the part timeout or one of its own
    writes failed), which the others read from the store; a process still writing its share when the
    verdict appears abandons those writes, so a write the store holds back costs that save, not the
    ones after it. A failed temporary save is logged and skipped (the permanent checkpoints still
    protect the run).

    Resume (:meth:`restore_latest`) takes the newest committed checkpoint of either tier (the permanent
    one where both hold the same step). A temporary store that cannot be read (gone, unreachable,
    permission denied) is logged and the permanent checkpoints are used. Evaluation, sampling and export
    read only the permanent ones (:func:`committed_steps`): the temporary one exists to resume.
    """

    def __init__(self, output_path: str, policy: CheckpointPolicy, *, is_writer: bool = True,
                 part_timeout_s: float = PART_TIMEOUT_S, temp_path: str | None = None,
                 handoffs: Mapping[int, str] | None = None) -> None:
        self.output_path = output_path
        self.handoffs = dict(handoffs or {})  # {step: why}: the checkpoints transport switches hand off from
        self.permanent = TierStore(f"{output_path.rstrip('/')}/{CHECKPOINT_DIR}", PERMANENT)
        self.root_url, self.fs, self.root = self.permanent.root_url, self.permanent.fs, self.permanent.root
        self.temporary = TierStore(temp_checkpoint_root(temp_path, output_path), TEMPORARY) if temp_path else None
        self.policy = policy
        self.is_writer = is_writer
        self.part_timeout_s = part_timeout_s
        self._last_save_step: int | None = None
        self._last_save_time = time.monotonic()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._in_flight: concurrent.futures.Future | None = None
        self._save_started = 0.0
        self.last_blocking_s = 0.0  # time the latest save held the caller (staging to host memory)
        self.last_save_s: float | None = None  # staging + writing + commit of the latest finished save
        self.failed_saves = 0  # permanent saves of this attempt that failed
        self.failed_in_a_row = 0  # ... since the last one that committed
        self._failed_steps: list[int] = []  # the save points that failed since the last one that committed
        self.last_failure: str | None = None
        self.last_committed_step: int | None = None  # the newest permanent save this process saw commit
        self._last_commit_time = time.monotonic()
        self._tries: tuple[str, int] = ("", 0)  # (directory, how many saves of it) of the latest save

    def path_for(self, step: int) -> str:
        """The directory of the committed checkpoint at ``step`` in whichever tier holds it (the
        permanent one where both do); the permanent directory for a step not committed anywhere."""
        found = self.committed().get(step)
        return found if found is not None else self.permanent.url(step)

    def _step_dirs(self) -> dict[int, str]:
        return self.permanent.step_dirs()

    def committed_steps(self) -> list[int]:
        """Steps with a complete permanent checkpoint, ascending."""
        return self.permanent.committed_steps()

    def _is_committed(self, fs_path: str) -> bool:
        return self.permanent.is_committed(fs_path)

    def _temp_steps(self) -> list[int]:
        """The committed temporary checkpoints; none, with a warning, when the store cannot be read."""
        if self.temporary is None:
            return []
        try:
            return self.temporary.committed_steps()
        except Exception as e:  # noqa: BLE001 - every storage library's error means "not usable now"
            logger.warning("the temporary checkpoint store %s cannot be read (%s); using the permanent checkpoints",
                           self.temporary.root_url, one_line(e))
            return []

    def committed(self) -> dict[int, str]:
        """``{step: checkpoint directory}`` of every committed checkpoint of both tiers; a step both
        hold maps to the permanent one."""
        found = {s: self.temporary.url(s) for s in self._temp_steps()} if self.temporary is not None else {}
        found.update({s: self.permanent.url(s) for s in self.committed_steps()})
        return dict(sorted(found.items()))

    def latest_step(self) -> int | None:
        """The newest committed checkpoint of either tier."""
        steps = list(self.committed())
        return steps[-1] if steps else None

    def should_save(self, step: int, *, now: float | None = None) -> bool:
        """Whether a permanent checkpoint of the state after ``step`` completed steps is due."""
        if step > 0 and step % self.policy.every_steps == 0:
            return True
        if self.policy.every_minutes is not None and step != self._last_save_step:
            now = time.monotonic() if now is None else now
            return now - self._last_save_time >= 60.0 * self.policy.every_minutes
        return False

    def due(self, step: int, *, now: float | None = None) -> str | None:
        """Which checkpoint of the state after ``step`` is due: :data:`PERMANENT`, :data:`TEMPORARY`
        (the wall time since the last save of either tier reached ``temp_every_minutes``) or None."""
        now = time.monotonic() if now is None else now
        if self.should_save(step, now=now):
            return PERMANENT
        every = self.policy.temp_every_minutes
        if (self.temporary is not None and every is not None and step > 0 and step != self._last_save_step
                and now - self._last_save_time >= 60.0 * every):
            return TEMPORARY
        return None

    def save(self, step: int, tree: Any, metadata: Mapping[str, Any], *, blocking: bool = False,
             tier: str = PERMANENT) -> str:
        """Start saving ``tree`` as the checkpoint of ``step`` in ``tier``: waits for the previous save,
        copies this process's shards to host memory, and writes them in the background
        (``blocking=True``: waits for the commit too)."""
        if tier not in (PERMANENT, TEMPORARY) or (tier == TEMPORARY and self.temporary is None):
            raise ValueError(f"cannot save a {tier!r} checkpoint (temporary store: "
                             f"{self.temporary.root_url if self.temporary else 'none'})")
        store = self.permanent if tier == PERMANENT else self.temporary
        self.wait()
        t0 = time.perf_counter()
        path = store.url(step)
        _, count = process_and_count()
        if count == 1:
            try:
                if store.fs.exists(store.fs_path(step)):
                    # A leftover of a crashed attempt at the same step: never committed (a committed one
                    # would have been resumed from), safe to replace. (With several processes, the writer
                    # clears leftovers before training starts: see clear_uncommitted.)
                    delete_dir(store.fs, store.fs_path(step))
            except Exception:
                if tier == PERMANENT:
                    raise
                # an unreachable temporary store: the write below fails and is logged
        # every process of the pool saves at the same points, so the nth try of a directory is the same
        # try everywhere: process 0's verdict names it (an ABORT of an earlier try is not this one's)
        tries = self._tries[1] + 1 if self._tries[0] == path else 1
        self._tries = (path, tries)
        staged = stage(path, tree, metadata, step=step, save_try=tries)
        self.last_blocking_s = time.perf_counter() - t0
        self._save_started = t0
        self._last_save_step = step
        self._last_save_time = time.monotonic()
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._in_flight = self._pool.submit(self._write, staged, store)
        if blocking:
            self.wait()
        return path

    def save_temporary(self, step: int, tree: Any, metadata: Mapping[str, Any], *, blocking: bool = False) -> str:
        """:meth:`save` to the temporary store (the rolling checkpoint: one kept)."""
        return self.save(step, tree, metadata, blocking=blocking, tier=TEMPORARY)

    def _write(self, staged: Staged, store: TierStore | None = None) -> None:
        store = store or self.permanent
        try:
            write_staged(staged, part_timeout_s=self.part_timeout_s)
        except CheckpointWriteError as e:
            if store.tier == PERMANENT:
                self._failed(staged.step, e)
                return
            logger.warning("temporary checkpoint skipped: %s (the permanent checkpoints still protect the run)", e)
            return
        if store.tier == PERMANENT:
            self.failed_in_a_row, self.last_committed_step, self._failed_steps = 0, staged.step, []
            self._last_commit_time = time.monotonic()
        self.last_save_s = time.perf_counter() - self._save_started
        logger.info("saved %s checkpoint %s (%.1f MB from this process)", store.tier, staged.path, staged.nbytes / 1e6)
        if not self.is_writer:
            return
        if store.tier == PERMANENT:
            self.collect_garbage(current=staged.step)
            self._prune_temporary(through=staged.step)
        else:
            self._prune_temporary(keep=staged.step)

    def _failed(self, step: int, error: CheckpointWriteError) -> None:
        """Count a failed permanent save; raise :class:`SavesFailing` once the policy's limit is reached."""
        self.failed_saves += 1
        self.failed_in_a_row += 1
        self._failed_steps.append(step)
        self.last_failure = str(error)
        self._recount_from_store()
        limit, minutes = self.policy.max_failed_saves, self.policy.max_minutes_without_commit
        age_min = (time.monotonic() - self._last_commit_time) / 60.0
        newest = (self.permanent.url(self.last_committed_step) if self.last_committed_step is not None
                  else "none in this attempt")
        if self.failed_in_a_row >= limit or (minutes is not None and age_min > minutes):
            n = self.failed_in_a_row
            why = (f"{n} permanent save{'s' if n > 1 else ''} in a row failed (checkpoint.max_failed_saves={limit})"
                   if self.failed_in_a_row >= limit else
                   f"the newest commit is {age_min:.0f} min old (checkpoint.max_minutes_without_commit={minutes:g})")
            raise SavesFailing(f"{why}; the last, at step {step}: {error}. The attempt ends and is retried from "
                               f"the newest committed checkpoint ({newest})") from error
        logger.warning("checkpoint save at step %d failed (%d of %d in a row allowed): %s; training goes on and the "
                       "next save point tries again (newest committed: %s)", step, self.failed_in_a_row, limit,
                       error, newest)

    def _recount_from_store(self) -> None:
        """The store is the authority on what committed. Every process reads each save's outcome from
        the store (process 0's COMMIT or ABORT), but a process that waited for it in vain gives up, and
        process 0 may commit after that (its previous save held it for up to the part timeout), or
        its COMMIT may land although the store's answer was lost: failures in a row count only the
        save points after the newest commit on the store, so every process of the pool reaches
        checkpoint.max_failed_saves at the same save point (one ending the attempt alone leaves the
        others waiting in a collective)."""
        try:
            newest = max(self.committed_steps(), default=None)
        except Exception:  # noqa: BLE001 - a store that cannot be read now: this process's own count stands
            return
        if newest is not None and (self.last_committed_step is None or newest > self.last_committed_step):
            self.last_committed_step = newest
            self._last_commit_time = time.monotonic()  # the first this process knows of it
            self._failed_steps = [s for s in self._failed_steps if s > newest]
            self.failed_in_a_row = len(self._failed_steps)

    def ensure_saved(self, step: int, tree: Any, metadata: Mapping[str, Any]) -> str:
        """The run's last checkpoint must exist: wait for the save in flight and, while ``step`` has not
        committed here, save it again (blocking) until it does or :class:`SavesFailing` ends the attempt."""
        self.wait()
        while self.last_committed_step != step:
            self.save(step, tree, metadata, blocking=True)
        return self.permanent.url(step)

    def _prune_temporary(self, *, keep: int | None = None, through: int | None = None) -> list[int]:
        """Delete temporary checkpoints: every one but ``keep`` (one kept), or every one at or before
        ``through`` (a newer permanent one committed). Failures are logged: the store may be gone."""
        if self.temporary is None:
            return []
        deleted = []
        try:
            for s, p in sorted(self.temporary.step_dirs().items()):
                if (keep is not None and s != keep) or (through is not None and s <= through):
                    delete_dir(self.temporary.fs, p)
                    deleted.append(s)
        except Exception as e:  # noqa: BLE001 - every storage library's error means "not usable now"
            logger.warning("could not prune the temporary checkpoints in %s: %s", self.temporary.root_url, one_line(e))
        return deleted

    def check(self) -> None:
        """Raise the error of a finished background save, if it failed (cheap; call once per step)."""
        f = self._in_flight
        if f is not None and f.done():
            self._in_flight = None
            f.result()

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; raises its error."""
        f, self._in_flight = self._in_flight, None
        if f is not None:
            f.result()

    def close(self) -> None:
        """Wait for the save in flight and stop the writer thread."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def restore(self, step: int, template: Any = None, shardings: Any = None) -> tuple[Any, dict[str, Any]]:
        return restore_checkpoint(self.path_for(step), template, shardings)

    def restore_latest(self, template: Any = None, shardings: Any = None) -> tuple[int, Any, dict[str, Any]] | None:
        """``(step, tree, metadata)`` of the newest checkpoint of either tier that verifies, or None if
        there is none.

        A committed checkpoint that fails verification (a part missing, a chunk truncated by a kill
        during a copy, a lost file) is logged, moved aside to ``step-N.corrupt-<unix time>`` (kept for
        inspection, ignored by discovery and retention) and the next older one is tried: one damaged
        checkpoint costs the steps since the previous save, not the run. A temporary checkpoint that
        cannot be read at all (its store went away between listing and reading) is skipped the same
        way. A structural mismatch is not damage and is raised as is.
        """
        for step, url in reversed(list(self.committed().items())):
            store = self.permanent if url == self.permanent.url(step) else self.temporary
            try:
                tree, meta = restore_checkpoint(url, template, shardings)
            except (CorruptCheckpointError, FileNotFoundError) as e:
                aside = f"{url}.corrupt-{int(time.time())}"
                logger.warning("%s checkpoint at step %d does not verify (%s); moving it to %s and trying the "
                               "previous one", store.tier, step, e, aside)
                if self.is_writer:
                    try:
                        store.move_aside(step, aside)
                    except Exception as moved:  # noqa: BLE001 - a vanished temporary store cannot take it
                        if store.tier == PERMANENT:
                            raise
                        logger.warning("could not move %s aside: %s", url, one_line(moved))
                continue
            except CheckpointMismatchError:
                raise
            except Exception as e:  # noqa: BLE001 - a temporary store that stopped answering mid-read
                if store.tier == PERMANENT:
                    raise
                logger.warning("temporary checkpoint at step %d cannot be read (%s); trying the previous one",
                               step, one_line(e))
                continue
            if store.tier == TEMPORARY:
                logger.info("resuming from the temporary checkpoint %s (newer than every permanent one)", url)
            return step, tree, meta
        return None

    def _move_aside(self, step: int, aside_url: str) -> None:
        self.permanent.move_aside(step, aside_url)

    def mark_restored(self, step: int) -> None:
        """Start the wall-time clock from a restore, as if that checkpoint had just been written."""
        self._last_save_step = step
        self._last_save_time = self._last_commit_time = time.monotonic()
        self.last_committed_step = step

    def clear_uncommitted(self) -> list[int]:
        """Delete step directories without COMMIT (a crashed save's leftovers), in both tiers. Only the
        writer calls this, before training starts, so no save of this attempt is racing it."""
        deleted = []
        for s, p in sorted(self._step_dirs().items()):
            if not self._is_committed(p):
                delete_dir(self.fs, p)
                deleted.append(s)
        if self.temporary is not None:
            try:
                for p in self.temporary.step_dirs().values():
                    if not self.temporary.is_committed(p):
                        delete_dir(self.temporary.fs, p)
            except Exception as e:  # noqa: BLE001 - every storage library's error means "not usable now"
                logger.warning("could not clear the temporary checkpoint store %s: %s", self.temporary.root_url,
                               one_line(e))
        return deleted

    def pins(self) -> dict[int, list[str]]:
        """``{step: [why]}`` of every pinned checkpoint: ``checkpoint.pinned_steps``, the transport
        handoffs, and the pins other steps wrote (a branch's source, a gate until its verdict)."""
        pins: dict[int, list[str]] = {int(s): ["checkpoint.pinned_steps"] for s in self.policy.pinned_steps}
        for s, why in self.handoffs.items():
            pins.setdefault(int(s), []).append(why)
        for s, who in read_pins(self.output_path).items():
            pins.setdefault(s, []).extend(who)
        return pins

    def retention_plan(self, current: int | None = None) -> dict[int, str]:
        """``{step: "keep: why" or "delete: why"}`` for every permanent step directory: what
        :meth:`collect_garbage` does next (``marin checkpoints`` shows it)."""
        dirs = self._step_dirs()
        committed = [s for s, p in dirs.items() if self._is_committed(p)]
        kept = self.policy.retention(committed, self.pins(), current)
        return {s: kept.get(s) or ("keep: being written" if s == current else "delete: never committed")
                for s in sorted(dirs)}

    def collect_garbage(self, current: int | None = None) -> list[int]:
        """Delete uncommitted leftovers and committed permanent checkpoints outside the retention policy;
        never a pinned one. A delete the store refuses is logged and tried again at the next save,
        never fatal: training goes on with one checkpoint more."""
        dirs = self._step_dirs()
        deleted = []
        for s, action in self.retention_plan(current).items():
            # a directory that appeared after the listing above (another process's late part of a save
            # that already failed here) is left to the next collection
            if not action.startswith("delete") or s not in dirs:
                continue
            try:
                delete_dir(self.fs, dirs[s])
            except Exception as e:  # noqa: BLE001 - a bucket policy or an outage: the next save tries again
                logger.warning("could not delete checkpoint %s (%s): %s; retention tries again after the next save",
                               dirs[s], action, one_line(e))
                continue
            deleted.append(s)
        return deleted
