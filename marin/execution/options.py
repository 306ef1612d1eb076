"""The run options, defined once: the flags every experiment file takes (:class:`ExecutorMainConfig`)
and what a run adds to them (:class:`RunOptions`: its prefix resolved, its description and card,
the script that runs it, its name among the experiment's records)."""

from __future__ import annotations

import dataclasses
import math
import re

from marin.execution.experiment_record import new_run_id
from marin.execution.lease import DEFAULT_TTL_S


class FlagError(ValueError):
    """An executor flag with a value no run can use; the message is one line naming the flag."""


@dataclasses.dataclass
class ExecutorMainConfig:
    """Flags of every experiment file (``python exp.py --help`` or ``marin run exp.py --help``)."""

    prefix: str | None = None
    """Where outputs go: a local directory, s3://bucket/path or gs://bucket/path. Default: $MARIN_PREFIX,
    else ./local_store under the working directory."""
    dry_run: bool = False
    """Plan, print what would run (and code drift warnings), run nothing."""
    force_run_failed: bool = False
    """Rerun steps that FAILED in an earlier run (off by default: a failure needs a look first)."""
    run_only: list[str] | None = None
    """Regexes: run only matching steps plus their unfinished dependencies (``--run_only a b``)."""
    max_concurrent: int | None = None
    """At most this many steps running at once (default: as many as Ray's resources allow)."""
    address: str | None = None
    """Ray cluster to join (default: $RAY_ADDRESS, else start a local cluster)."""
    lease_ttl: float = DEFAULT_TTL_S
    """Seconds a step lease lives without heartbeat; a dead executor's steps are taken over after it."""
    progress: bool = True
    """Show a progress bar on stderr."""
    infra_retries: int | None = None
    """Times every step is retried by itself after an infrastructure failure (a host, worker or node
    died, a preemption, a storage outage past its retry limit), each from what it committed (a
    training step resumes from its last checkpoint), with backoff; 0 turns this off. Default: each
    step's own: training and evaluation on a GPU pool 2, on a local CPU pool 0, other steps
    (tokenize, fits, reports) 0. Failures of the step itself (divergence, a config error, a bug) are
    never retried."""
    retry_failed: list[str] | None = None
    """Steps (names or regexes, ``--retry_failed A B``) whose earlier FAILED attempt may run again,
    without --force_run_failed for every failed step."""
    repair_records: bool = False
    """Rebuild status records that cannot be read (torn, truncated) where that is safe, and say how
    (off by default: the run stops and lists them, since their outputs may be complete)."""


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_flags(flags: ExecutorMainConfig) -> ExecutorMainConfig:
    """``flags`` if every flag holds a value a run can use, else :class:`FlagError` in one line naming
    the flag. Checked before anything is planned: ``--max_concurrent 0`` or ``-1`` would otherwise
    submit no step and wait forever, a regex that does not compile would fail only after the
    statuses were read, and a lease that lives 0 seconds is lost as soon as it is taken."""
    if flags.max_concurrent is not None and not (_count(flags.max_concurrent) and flags.max_concurrent >= 1):
        raise FlagError(f"--max_concurrent must be a whole number >= 1 (or left out: as many as Ray's resources "
                        f"allow), got {flags.max_concurrent!r}")
    if flags.infra_retries is not None and not (_count(flags.infra_retries) and flags.infra_retries >= 0):
        raise FlagError(f"--infra_retries must be a whole number >= 0 (or left out: each step's own), "
                        f"got {flags.infra_retries!r}")
    ttl = flags.lease_ttl
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not (math.isfinite(ttl) and ttl > 0):
        raise FlagError(f"--lease_ttl must be a finite number of seconds > 0, got {ttl!r}")
    for flag in ("run_only", "retry_failed"):
        for pattern in getattr(flags, flag) or ():
            try:
                re.compile(pattern)
            except re.error as e:
                raise FlagError(f"--{flag} {pattern!r} is not a regular expression: {e}") from None
    return flags


@dataclasses.dataclass(kw_only=True)
class RunOptions(ExecutorMainConfig):
    """One run's options: the flags, with the prefix resolved, and what the run adds to them."""

    prefix: str
    """The resolved prefix (the plan's)."""
    poll_interval: float = 0.5
    """Seconds between looks at a step whose lease another live driver holds."""
    description: str | None = None
    card: dict[str, str] | None = None
    """The experiment card: hypothesis, goal, risks, contingency (see :func:`marin.execution.main.experiment_card`)."""
    script: str = "experiment"
    run_id: str = dataclasses.field(default_factory=lambda: new_run_id())
    """This run's name among its experiment's records (see :func:`experiment_runs_dir`)."""

    @classmethod
    def of(cls, flags: ExecutorMainConfig, **run: object) -> "RunOptions":
        """The run options of ``flags`` (every flag as given) plus the run's own fields ``run``
        (``prefix`` at least)."""
        return cls(**{**{f.name: getattr(flags, f.name) for f in dataclasses.fields(ExecutorMainConfig)}, **run})
