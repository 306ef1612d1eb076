"""Paired gates: before a live run changes, its control and each candidate train from the same checkpoint
on the same batches, and a verdict in ``gate.json`` says whether the change may go in.

A long run changes while it runs (its transport, its kernels, its sequence length, a modelling knob),
and each change is decided by a *paired gate*: restore the run's committed checkpoint at ``at_step``
(weights, AdamW state, data position), train the run's own settings (the control) and each candidate
for ``steps`` steps from that same state on identical batches, and compare throughput, token drops,
loss and memory. Because both arms see the same batches from the same state, the per-step loss
difference is paired: most of the batch-to-batch noise cancels, and its confidence interval is far
narrower than the two loss curves' spread.

This module is JAX-free (experiment files and the CLI import it): the gate's configuration
(:class:`GateConfig`, :class:`GateThresholds`), which changes a restored state can take
(:func:`arm_config`, refused in one line with :class:`GateRefused`), the verdict math as pure
functions (:func:`paired_difference`, :func:`step_time_summary`, :func:`judge`, :func:`gate_report`)
and the verdict's file. The arms run in :mod:`marin.training.gate_run` (the executor step is
:func:`marin.training.steps.gate`); a live run's changes that rest
on a gate are checked by :mod:`marin.training.cutover`.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from marin.execution.fieldcheck import check_fields
from marin.execution.versioning import input_field, rule
from marin.models.config import param_shapes
from marin.parallel.capacity import TRANSPORTS
from marin.pools import PoolSpec, as_pool
from marin.training.config import InitFrom, TrainConfig
from marin.training.schedule import transport_at

GATE_FILE = "gate.json"
"""In a gate step's directory: per arm the window's telemetry, the paired loss difference, the verdict."""

GATE_PLOT = "gate.png"
"""In a gate step's directory: the arms' loss and step time over the window."""

CONTROL = "control"
"""The arm that trains the run's own settings."""


class GateRefused(ValueError):
    """A gate (or a cutover) that cannot be run as asked; the message is one line saying why."""


@dataclasses.dataclass(frozen=True)
class GateThresholds:
    """What a candidate must show against the control to pass (each is named in the verdict line).

    ``max_loss_delta``: the upper end of the confidence interval of the paired loss difference
    (candidate - control, nats, over the window) may not exceed it: the candidate is not worse by more
    than this with the gate's confidence. ``min_speedup``: control median step time / candidate's
    (0.95: at most 5% slower; 0 for a modelling gate where speed is not the question).
    ``max_drop_fraction``: the fraction of routed assignments the candidate dropped over the window,
    send and receive side together (:func:`dropped`); 0.08 is the healthy limit of the fixed
    transport on the published run.
    ``max_memory_fraction``: the candidate's peak device memory over the device's memory, judged only
    where the backend reports memory (GPUs; a CPU does not).
    """

    max_loss_delta: float = 0.02
    min_speedup: float = 0.95
    max_drop_fraction: float = 0.08
    max_memory_fraction: float = 0.95

    def __post_init__(self) -> None:
        check_fields(self, "thresholds.", {"max_loss_delta": ">= 0", "min_speedup": ">= 0",
                                           "max_drop_fraction": "[0, 1]", "max_memory_fraction": "(0, 1]"})


@dataclasses.dataclass(frozen=True)
class GateConfig:
    """A paired gate of the run at ``run`` (a training step's output directory) at its committed
    checkpoint ``at_step``: the control and each of ``candidates`` (label -> changes, see
    :func:`arm_config`) train ``steps`` steps from that checkpoint on the run's batches.

    ``pool``: where the arms run (None: the run's own pool; a name is resolved to its PoolSpec here);
    another pool must have the run's device kind, and a smaller one is allowed and said in gate.json
    (its step times are not the run's).
    ``checkpoint_every``: the arms' checkpoint cadence, so a gate killed midway resumes each arm
    from its own newest checkpoint (None: twice per window). ``confidence``: of the paired loss
    difference's interval.
    """

    run: str = input_field()
    output_path: str = input_field()
    at_step: int = 0
    candidates: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    steps: int = 200
    pool: PoolSpec | None = None
    thresholds: GateThresholds = dataclasses.field(default_factory=GateThresholds)
    checkpoint_every: int | None = None
    confidence: float = 0.95

    def __post_init__(self) -> None:
        if self.pool is not None:  # resolved once, here, as TrainConfig's: the spec travels, no process looks it up
            object.__setattr__(self, "pool", as_pool(self.pool))
        check_fields(self, "gate ")  # whole numbers and a finite confidence; their ranges below, with why
        if self.at_step <= 0 or self.steps < 2:
            raise GateRefused(f"a gate needs at_step > 0 (a committed checkpoint) and steps >= 2 (a paired "
                              f"difference has a spread), got at_step={self.at_step}, steps={self.steps}")
        if not self.candidates:
            raise GateRefused("a gate needs at least one candidate: candidates={label: {field: value}}")
        if CONTROL in self.candidates:
            raise GateRefused(f"{CONTROL!r} is the arm of the run's own settings; name the candidate otherwise")
        if not 0 < self.confidence < 1:
            raise GateRefused(f"confidence must be in (0, 1), got {self.confidence}")
        if self.checkpoint_every is not None and self.checkpoint_every <= 0:
            raise GateRefused(f"checkpoint_every must be > 0 (or None), got {self.checkpoint_every}")

    @property
    def end_step(self) -> int:
        """The step the arms stop at: the window is steps ``at_step + 1 .. end_step``."""
        return self.at_step + self.steps

    @property
    def arm_checkpoint_every(self) -> int:
        return self.checkpoint_every or max(1, self.steps // 2)


# ---- which changes a restored state can take -------------------------------------------------------

TRANSPORT = "transport"
"""A change's shorthand for "the EP transport from the gate's step on" (it sets the transport switches)."""

REFUSED_FIELDS = {
    "data": "it changes the batches, so the arms would not be paired (gate a mixture change on a branch)",
    "seed": "it changes the batches and the state's key, so the arms would not be paired",
    "tokens_per_step": "it changes the batches, so the arms would not be paired",
    "train_steps": "it is the horizon as planned; move the horizon of a live run with optimizer.lr_replans",
    "pool": "the gate's pool= says where every arm runs",
    "init_from": "the gate itself says where the arms start",
    "output_path": "the gate writes its arms under its own directory",
    "preset": "it is a name; change the model's fields (model.remat_policy, ...)",
    "checkpoint": "the gate sets its arms' own checkpoints",
    "telemetry": "the gate sets its arms' own telemetry",
    "evaluation": "the arms do not evaluate; a gate compares training loss on identical batches",
    "stall": "the gate's arms run under the run's stall watchdog",
}
"""TrainConfig fields a gate's candidate may not change, with why."""


def _group_fields(config: TrainConfig) -> dict[str, type]:
    return {f.name: type(getattr(config, f.name)) for f in dataclasses.fields(config)
            if dataclasses.is_dataclass(getattr(config, f.name)) and rule(f)[0] == "group"}


def _transport_switches(config: TrainConfig, at_step: int, transport: str) -> tuple[tuple[int, str], ...]:
    """The run's transport switches up to ``at_step``, then ``transport`` from ``at_step`` on."""
    kept = tuple((int(s), str(t)) for s, t in config.parallelism.transport_switches if int(s) < at_step)
    return (kept or ((0, config.model.transport),)) + ((int(at_step), str(transport)),)


def arm_config(config: TrainConfig, changes: Mapping[str, Any], at_step: int, label: str = "candidate"
               ) -> TrainConfig:
    """The run's ``config`` with a candidate's ``changes`` applied: ``{"transport": "ragged_capacity"}``
    (the EP transport from ``at_step`` on), ``{"parallelism.microbatches": 4}``, ``{"optimizer.peak_lr":
    1e-3}``, ``{"model.remat_policy": "full"}``, ``{"seq_len_phases": ((0.0, 64), (0.5, 128))}``: a
    TrainConfig field, or a field of one of its groups or of the model as ``group.field``.

    A change a state restored at ``at_step`` cannot take is refused with :class:`GateRefused`, in one
    line naming the candidate and the field: one that changes the batches (data, seed, batch size: the
    arms would not be paired), a model field that changes the shape of the weights, a transport switch
    or LR re-plan rewritten before ``at_step`` (what already ran), a field the gate sets itself (pool,
    checkpoints, telemetry), an unknown field, or a value the field's own checks refuse.
    """
    where = f"candidate {label!r}"
    top: dict[str, Any] = {}
    grouped: dict[str, dict[str, Any]] = {}
    groups = _group_fields(config)
    for path, value in changes.items():
        head, _, rest = path.partition(".")
        if path == TRANSPORT:
            if value not in TRANSPORTS:
                raise GateRefused(f"{where}: unknown transport {value!r}; choose from {', '.join(TRANSPORTS)}")
            grouped.setdefault("parallelism", {})["transport_switches"] = _transport_switches(config, at_step, value)
        elif head in REFUSED_FIELDS:
            raise GateRefused(f"{where}: {path} cannot be a gate's change: {REFUSED_FIELDS[head]}")
        elif head == "model" and rest:
            if not hasattr(config.model, rest):
                raise GateRefused(f"{where}: the model has no field {rest!r}")
            grouped.setdefault("model", {})[rest] = value
        elif head in groups and rest:
            if rest not in {f.name for f in dataclasses.fields(groups[head])}:
                raise GateRefused(f"{where}: {head} ({groups[head].__name__}) has no field {rest!r}")
            grouped.setdefault(head, {})[rest] = value
        elif path in {f.name for f in dataclasses.fields(config)} and path not in groups and path != "model":
            top[path] = value
        else:
            raise GateRefused(f"{where}: unknown field {path!r}; a change names {TRANSPORT!r}, a TrainConfig field "
                              "(seq_len_phases) or group.field (parallelism.microbatches, optimizer.peak_lr, "
                              "model.remat_policy)")
    try:
        model = config.model.replace(**grouped.pop("model")) if "model" in grouped else config.model
        new = {name: dataclasses.replace(getattr(config, name), **fields) for name, fields in grouped.items()}
        out = dataclasses.replace(config, model=model, **new, **top)
    except (TypeError, ValueError) as e:
        raise GateRefused(f"{where}: {' '.join(str(e).split())}") from None
    before, after = param_shapes(config.model), param_shapes(out.model)
    if before != after:
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        raise GateRefused(f"{where}: the change reshapes the weights ({', '.join(changed[:4])}), which a state "
                          f"restored at step {at_step} cannot take; branch a new run instead")
    before_t, after_t = config.transport_schedule(config.model.transport), out.transport_schedule(out.model.transport)
    points = {int(s) for s, _ in (*before_t.switches, *after_t.switches) if int(s) < at_step}
    rewritten = [name for name, same in (
        ("parallelism.transport_switches", all(transport_at(p, before_t) == transport_at(p, after_t) for p in points)),
        ("optimizer.lr_replans", [tuple(x) for x in config.optimizer.lr_replans if int(x[0]) < at_step]
         == [tuple(x) for x in out.optimizer.lr_replans if int(x[0]) < at_step])) if not same]
    if rewritten:
        raise GateRefused(f"{where}: {rewritten[0]} rewrites what ran before step {at_step}; a change starts at the "
                          "gate's step or later")
    return out


def check_pool(run_pool: str | PoolSpec, gate_pool: str | PoolSpec | None) -> str | None:
    """None when the arms run on the run's own pool; else the note gate.json carries (a smaller pool of
    the same device kind: its step times are not the run's). Another device kind is refused."""
    if gate_pool is None:
        return None
    run, gate = as_pool(run_pool), as_pool(gate_pool)
    if run.name == gate.name:
        return None
    if run.accelerator != gate.accelerator:
        raise GateRefused(f"the gate's pool {gate.name} has {gate.accelerator} devices but the run trains on "
                          f"{run.accelerator} ({run.name}); a gate measures on the run's device kind")
    if gate.num_devices > run.num_devices:
        raise GateRefused(f"the gate's pool {gate.name} ({gate.num_devices} devices) is larger than the run's "
                          f"{run.name} ({run.num_devices}); gate on the run's pool or a smaller one")
    return (f"arms ran on {gate.name} ({gate.num_devices} {gate.accelerator} devices), smaller than the run's "
            f"{run.name} ({run.num_devices}): step times and memory are this pool's, not the run's")


def check_gate(gate: GateConfig, run_config: TrainConfig) -> dict[str, TrainConfig]:
    """The run's config with each candidate's changes (control first), or :class:`GateRefused` in one
    line: a pool of another device kind or larger than the run's, a window past the run's horizon, a
    change a restored state cannot take (:func:`arm_config`), a label that cannot name a directory."""
    check_pool(run_config.pool, gate.pool)
    if gate.end_step > run_config.total_steps:
        raise GateRefused(f"the window ends at step {gate.end_step}, past the run's horizon "
                          f"({run_config.total_steps}); start the gate earlier or shorten steps")
    arms = {CONTROL: run_config}
    for label, changes in gate.candidates.items():
        if not isinstance(changes, Mapping) or not changes:
            raise GateRefused(f"candidate {label!r}: changes must be a non-empty {{field: value}} mapping")
        if not label.replace("-", "").replace("_", "").isalnum():
            raise GateRefused(f"candidate {label!r}: a label names a directory; use letters, digits, - and _")
        arms[label] = arm_config(run_config, changes, gate.at_step, label)
    return arms


def arm_configs(gate: GateConfig, run_config: TrainConfig) -> dict[str, TrainConfig]:
    """Every arm's TrainConfig (control first, see :func:`check_gate`), each starting at the run's
    checkpoint ``at_step`` with its optimizer state and data position, writing under
    ``{gate output}/arms/{label}``."""
    arms = check_gate(gate, run_config)
    out = {}
    for label, cfg in arms.items():
        out[label] = dataclasses.replace(
            cfg, output_path=f"{gate.output_path.rstrip('/')}/arms/{label}",
            init_from=InitFrom(run=gate.run, step=gate.at_step, optimizer=True, data_position=True),
            pool=gate.pool if gate.pool is not None else cfg.pool, cutovers=(),
            checkpoint=dataclasses.replace(cfg.checkpoint, every_steps=gate.arm_checkpoint_every, every_minutes=None,
                                           keep_last=1, keep_every=None, temp_every_minutes=None, pinned_steps=(),
                                           storage_quota=None),
            evaluation=dataclasses.replace(cfg.evaluation, every_steps=None, tasks={}),
            telemetry=dataclasses.replace(cfg.telemetry, log_every=1, wandb_project=None))
    return out


# ---- the verdict math (pure) ------------------------------------------------------------------------


def paired_difference(control: Sequence[float], candidate: Sequence[float], confidence: float = 0.95
                      ) -> dict[str, float]:
    """Mean of ``candidate[i] - control[i]`` (losses on the same batches) with its two-sided Student-t
    confidence interval: ``mean -/+ t(confidence, n - 1) * sd / sqrt(n)``.

    The steps of a window are treated as independent draws; consecutive differences are in fact
    correlated (the arms' weights drift apart slowly), so the interval is a little optimistic over long
    windows. Non-finite pairs make the whole difference non-finite (a diverged arm has no interval).
    """
    if len(control) != len(candidate):
        raise ValueError(f"paired difference needs equal lengths, got {len(control)} and {len(candidate)}")
    n = len(control)
    if n < 2:
        raise ValueError(f"paired difference needs at least 2 pairs, got {n}")
    diffs = [float(b) - float(a) for a, b in zip(control, candidate)]
    if not all(math.isfinite(d) for d in diffs):
        return {"mean": math.nan, "low": math.nan, "high": math.nan, "sd": math.nan, "n": n, "confidence": confidence}
    from scipy.stats import t as student_t  # scipy.stats: slow to import; only where a verdict is computed

    mean, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    half = float(student_t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
    return {"mean": mean, "low": mean - half, "high": mean + half, "sd": sd, "n": n, "confidence": confidence}


def step_time_summary(times: Sequence[float]) -> dict[str, float]:
    """Median step time and its spread: the 10th and 90th percentiles (linear interpolation) and
    ``spread = (p90 - p10) / median``, over steps that compiled nothing (the caller leaves those out)."""
    if not times:
        return {"median_s": math.nan, "p10_s": math.nan, "p90_s": math.nan, "spread": math.nan, "n": 0}
    xs = sorted(float(t) for t in times)

    def pct(q: float) -> float:
        pos = q * (len(xs) - 1)
        lo = int(math.floor(pos))
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    median = pct(0.5)
    return {"median_s": median, "p10_s": pct(0.1), "p90_s": pct(0.9),
            "spread": (pct(0.9) - pct(0.1)) / median if median > 0 else math.nan, "n": len(xs)}


def _mean(xs: Sequence[float]) -> float:
    xs = [float(x) for x in xs if x is not None]
    return statistics.fmean(xs) if xs else math.nan


def arm_summary(records: Sequence[Mapping[str, Any]], info: Mapping[str, Any]) -> dict[str, Any]:
    """One arm's window from its per-step records (``metrics.jsonl``: loss, grad_norm, drop fractions,
    step_time_s, compiled, mfu_step, batch_digest) and its ``arm.json`` (status, reason, peak memory)."""
    timed = [r for r in records if not r.get("compiled")]
    steady = [float(r["step_time_s"]) for r in timed if "step_time_s" in r]
    times = step_time_summary(steady)
    mfus = sorted(float(r["mfu_step"]) for r in timed if "mfu_step" in r)
    return {
        "status": info.get("status", "incomplete"),
        "reason": info.get("reason"),
        "steps": [int(r["step"]) for r in records],
        "loss": [float(r["loss"]) for r in records],
        "grad_norm": [float(r["grad_norm"]) for r in records],
        "step_time_s": [float(r.get("step_time_s", math.nan)) for r in records],
        "compiled": [bool(r.get("compiled")) for r in records],
        "batch_digests": [r.get("batch_digest") for r in records],
        "step_time": times,
        "mfu": statistics.median(mfus) if mfus else math.nan,
        "loss_mean": _mean([r["loss"] for r in records]),
        "loss_last": float(records[-1]["loss"]) if records else math.nan,
        "grad_norm_mean": _mean([r["grad_norm"] for r in records]),
        "grad_norm_max": max((float(r["grad_norm"]) for r in records), default=math.nan),
        "drop_frac_send": _mean([r.get("drop_frac_send", 0.0) for r in records]),
        "drop_frac_recv": _mean([r.get("drop_frac_recv", 0.0) for r in records]),
        "transport": sorted({str(r["transport"]) for r in records if "transport" in r}),
        "microbatches": info.get("microbatches"),
        "peak_memory_bytes": info.get("peak_memory_bytes"),
        "device_memory_bytes": info.get("device_memory_bytes"),
    }


def dropped(arm: Mapping[str, Any]) -> float:
    """The fraction of routed assignments an arm dropped: send and receive side together (both are
    fractions of all assignments, and a token dropped by the sender never reaches a receiver)."""
    return float(arm.get("drop_frac_send", 0.0)) + float(arm.get("drop_frac_recv", 0.0))


def _fmt(x: float, spec: str = ".4g") -> str:
    return format(x, spec) if math.isfinite(x) else str(x)


def judge(control: Mapping[str, Any], candidate: Mapping[str, Any], paired: Mapping[str, float],
          thresholds: GateThresholds, *, expected_steps: int) -> dict[str, Any]:
    """A candidate's verdict against the control: ``{"pass", "checks": [{name, ok, detail}], "line"}``.

    Checks: the arm finished its window with finite values (a diverged arm fails with its reason);
    ``max_loss_delta`` against the upper end of the paired difference's interval; ``min_speedup``
    against the control's median step time over the candidate's; ``max_drop_fraction`` against the
    fraction it dropped (:func:`dropped`); ``max_memory_fraction`` against its peak
    device memory, where the backend reports it. The line names every threshold it was judged on.
    """
    t = thresholds
    checks: list[dict[str, Any]] = []
    done = candidate.get("status") == "done" and len(candidate.get("steps") or []) == expected_steps
    finite = all(math.isfinite(x) for x in [*candidate.get("loss", []), *candidate.get("grad_norm", [])])
    # the trainer's reason up to where it names its checkpoints (an arm's are its own, removed at its end)
    reason = (candidate.get("reason") or "").split("; stopped without saving")[0] or (
        "" if done else f"{len(candidate.get('steps') or [])} of {expected_steps} steps ran")
    if candidate.get("status") == "diverged":
        reason = f"diverged: {reason}"
    checks.append({"name": "finished", "ok": done and finite,
                   "detail": f"{expected_steps} finite steps" if done and finite else (reason or "non-finite values")})
    high = float(paired.get("high", math.nan))
    checks.append({"name": "max_loss_delta", "ok": math.isfinite(high) and high <= t.max_loss_delta,
                   "detail": f"loss {_fmt(paired.get('mean', math.nan), '+.4f')} "
                             f"[{_fmt(paired.get('low', math.nan), '+.4f')}, {_fmt(high, '+.4f')}] vs max_loss_delta "
                             f"{t.max_loss_delta:g}"})
    c_med, k_med = control["step_time"]["median_s"], candidate["step_time"]["median_s"]
    speedup = c_med / k_med if math.isfinite(c_med) and math.isfinite(k_med) and k_med > 0 else math.nan
    checks.append({"name": "min_speedup", "ok": t.min_speedup <= 0 or (math.isfinite(speedup)
                                                                        and speedup >= t.min_speedup),
                   "detail": f"speedup {_fmt(speedup, '.3f')}x vs min_speedup {t.min_speedup:g}"})
    drop = dropped(candidate)
    checks.append({"name": "max_drop_fraction", "ok": math.isfinite(drop) and drop <= t.max_drop_fraction,
                   "detail": f"drops {_fmt(drop, '.3g')} vs max_drop_fraction {t.max_drop_fraction:g}"})
    peak, capacity = candidate.get("peak_memory_bytes"), candidate.get("device_memory_bytes")
    if peak and capacity:
        checks.append({"name": "max_memory_fraction", "ok": peak / capacity <= t.max_memory_fraction,
                       "detail": f"peak memory {peak / 2**30:.1f} of {capacity / 2**30:.1f} GiB vs "
                                 f"max_memory_fraction {t.max_memory_fraction:g}"})
    ok = all(c["ok"] for c in checks)
    failed = [c["name"] for c in checks if not c["ok"]]
    line = ("pass: " if ok else f"FAIL ({', '.join(failed)}): ") + "; ".join(c["detail"] for c in checks)
    return {"pass": ok, "checks": checks, "line": line, "speedup": speedup}


def gate_report(gate: GateConfig, arms: Mapping[str, Mapping[str, Any]], *, checkpoint: str, pool_note: str | None,
                changes: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """``gate.json``: the gate's settings, each arm's summary (:func:`arm_summary`), for each candidate
    the paired loss difference on identical batches and its verdict (:func:`judge`), and the gate's
    verdict line. ``identical_batches``: every arm's per-step batch fingerprints are the control's
    (a candidate that changed the batch shape, e.g. a sequence-length phase, is not paired: its
    difference is still reported and marked)."""
    control = arms[CONTROL]
    out_arms: dict[str, Any] = {}
    verdicts: dict[str, Any] = {}
    identical = True
    for label, arm in arms.items():
        entry = {"changes": dict((changes or {}).get(label, {})), **arm}
        if label != CONTROL:
            n = min(len(control["loss"]), len(arm["loss"]))
            # on the steps both arms ran (an arm that stopped early fails on "finished", not here)
            same = (n > 0 and control["steps"][:n] == arm["steps"][:n]
                    and control["batch_digests"][:n] == arm["batch_digests"][:n] and None not in arm["batch_digests"])
            identical = identical and same
            paired = (paired_difference(control["loss"][:n], arm["loss"][:n], gate.confidence) if n >= 2 else
                      {"mean": math.nan, "low": math.nan, "high": math.nan, "sd": math.nan, "n": n,
                       "confidence": gate.confidence})
            entry["identical_batches"] = same
            entry["paired_loss_delta"] = paired
            verdict = judge(control, arm, paired, gate.thresholds, expected_steps=gate.steps)
            if not same and arm.get("status") == "done":
                verdict["line"] += "; batches differ from the control's: the loss difference is not paired"
            entry["speedup"] = verdict.pop("speedup")
            entry["verdict"] = verdict
            verdicts[label] = verdict
        out_arms[label] = entry
    passed = [k for k, v in verdicts.items() if v["pass"]]
    line = "; ".join(f"{k}: {v['line']}" for k, v in verdicts.items())
    return {
        "run": gate.run, "at_step": gate.at_step, "steps": gate.steps, "window": [gate.at_step + 1, gate.end_step],
        "checkpoint": checkpoint, "pool_note": pool_note, "confidence": gate.confidence,
        "thresholds": dataclasses.asdict(gate.thresholds), "identical_batches": identical,
        "arms": out_arms, "passed": passed, "failed": [k for k in verdicts if k not in passed], "verdict": line,
    }
