"""A paired gate, run: each arm restores the run's checkpoint and trains the window; then ``gate.json``.

Each arm is a training run of its own under ``{gate}/arms/{label}`` (:func:`marin.training.gate.arm_configs`),
started from the run's committed checkpoint ``at_step`` through ``init_from`` (weights, AdamW state and
data position, so the batch at step N is the run's batch N) and driven here step by step with the
trainer's own parts (``setup_run``, ``run_step``, ``after_step``): the same compiled step, the same
batches, the same metrics records, plus what a gate measures per step (the step's wall time, whether
it compiled, its MFU, a fingerprint of the batch). An arm checkpoints into its own directory, so a
gate killed midway resumes each unfinished arm from its newest checkpoint; a finished arm leaves
``arm.json`` and its checkpoints are removed. The run's own directory gets nothing but the pins on
the gated checkpoint (the gate's, placed before the first arm starts, and each arm's, placed when it
restores), which keep the run's retention from deleting it while an arm may still read it. They are
released once ``gate.json`` is written: then no arm reads it again, a cutover relaunches the run from
its newest checkpoint, and a branch from the gated checkpoint holds a pin of its own. A gate that
ends before its verdict (killed, an arm's pool failed) keeps them, so it can resume.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from typing import Any

import fsspec
import jax
import numpy as np

from marin.execution.jsonable import to_jsonable
from marin.models.config import flops_per_token
from marin.parallel.mesh import batch_sharding
from marin.pools import HostContext, as_pool, launch, run_local
from marin.training.checkpoint.manager import pin_checkpoint, unpin_checkpoint
from marin.training.config import TrainConfig, model_at
from marin.training.gate import (
    CONTROL,
    GATE_FILE,
    GATE_PLOT,
    GateConfig,
    arm_configs,
    arm_summary,
    check_pool,
    gate_report,
)
from marin.training.metrics import WandbTracker, mfu, peak_flops_per_device, read_metrics
from marin.training.run import Run
from marin.training.schedule import seq_len_at
from marin.training.trainer import TrainingDiverged, after_step, host_rows, run_step, setup_run

logger = logging.getLogger(__name__)

ARM_FILE = "arm.json"
"""In an arm's directory once it ended: its status (done, diverged), why, and its peak device memory."""


def batch_digest(tokens: np.ndarray) -> str:
    """A fingerprint of a batch's tokens (this process's rows): equal digests, equal batches."""
    return hashlib.sha256(np.ascontiguousarray(tokens).tobytes()).hexdigest()[:16]


def peak_device_memory() -> tuple[int | None, int | None]:
    """(peak bytes in use, bytes the device has) over this process's devices, where the backend
    reports them (GPUs do; a CPU reports nothing: (None, None))."""
    peaks, limits = [], []
    for d in jax.local_devices():
        try:
            stats = d.memory_stats() or {}
        except Exception:  # noqa: BLE001 - a backend without memory statistics
            stats = {}
        if "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
        if "bytes_limit" in stats:
            limits.append(int(stats["bytes_limit"]))
    return (max(peaks) if peaks else None), (min(limits) if limits else None)


def _read_json(url: str) -> dict[str, Any] | None:
    fs, path = fsspec.core.url_to_fs(url)
    if not fs.exists(path):
        return None
    with fs.open(path) as f:
        return json.load(f)


def _write_json(url: str, doc: Any) -> None:
    with fsspec.open(url, "w") as f:
        json.dump(_finite(doc), f, indent=1)


def _finite(x: Any) -> Any:
    """JSON has no NaN: a non-finite float is written as its name ('nan', 'inf'), as metrics.jsonl does."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def train_arm(ctx: HostContext, config: TrainConfig, end_step: int, label: str,
              wandb: dict[str, str] | None = None) -> dict[str, Any]:
    """Train one arm on this process of its pool until ``end_step`` (or resume it); returns its
    ``arm.json``. A diverged arm ends with status "diverged" and the trainer's reason (the gate's
    verdict fails it), not with an error: the other arms still run."""
    out = config.output_path.rstrip("/")
    ended = _read_json(f"{out}/{ARM_FILE}")
    if ended is not None:  # a resumed gate: this arm had finished
        return ended
    run = setup_run(ctx, config)
    tracker = None
    if wandb and run.is_writer:
        tracker = WandbTracker(project=wandb["project"], name=f"{wandb['name']}/{label}", group=wandb["group"],
                               config=to_jsonable(config), output_path=out,
                               run_id=hashlib.sha256(out.encode()).hexdigest()[:16])
    pool = run.ctx.pool
    peak_flops = peak_flops_per_device(pool.accelerator)
    status, reason, exit_code = "done", None, 1
    run.t_prev = time.perf_counter()
    try:
        while run.step < end_step:
            step = run.step
            seq_len, batch_size = seq_len_at(step, run.total, config.seq_len_schedule())
            sharding = batch_sharding(run.mesh, model_at(config, run.cfg, seq_len).context_parallel)
            tokens = run.batch_fn(step, batch_size, seq_len, rows=host_rows(sharding, batch_size, seq_len))["tokens"]
            compiled_before = len(run.compiled)
            t0 = time.perf_counter()
            try:
                record = run_step(run)
            except TrainingDiverged as e:
                status, reason = "diverged", str(e)
                break
            dt = time.perf_counter() - t0
            record.update(step_time_s=dt, compiled=len(run.compiled) > compiled_before,
                          batch_digest=batch_digest(tokens),
                          mfu_step=mfu(batch_size * seq_len / dt, flops_per_token(run.cfg, seq_len), pool.num_devices,
                                       peak_flops))
            after_step(run, record)
            if tracker:
                tracker.log(record)
        exit_code = 0
    finally:
        try:
            run.ckpts.close()
        finally:
            run.metrics_out.close()
            if tracker:
                tracker.finish(exit_code)
    peak, capacity = peak_device_memory()
    info = {"label": label, "status": status, "reason": reason, "end_step": run.step, "resumed_from": run.resumed_from,
            "microbatches": sorted(set(run.micro.values())), "peak_memory_bytes": peak,
            "device_memory_bytes": capacity, "pool": pool.name, "num_devices": pool.num_devices}
    if run.is_writer:
        _write_json(f"{out}/{ARM_FILE}", info)
        fs, path = fsspec.core.url_to_fs(f"{out}/checkpoints")
        if fs.exists(path):  # the arm's state was only for resuming it; its records stay
            fs.rm(path, recursive=True)
    return info


def write_plot(doc: dict[str, Any], url: str) -> None:
    """``gate.png``: each arm's loss and step time over the window (steps that compiled left out of
    the step times)."""
    import matplotlib  # matplotlib: slow to import, only when drawing

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # (after choosing the Agg backend)

    fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(10, 3.4))
    for label, arm in doc["arms"].items():
        ax_loss.plot(arm["steps"], arm["loss"], label=label)
        timed = [(s, t) for s, t, c in zip(arm["steps"], arm["step_time_s"], arm["compiled"]) if not c]
        ax_time.plot([s for s, _ in timed], [t for _, t in timed], label=label)
    ax_loss.set(title=f"loss from step {doc['at_step']} (identical batches: {doc['identical_batches']})",
                xlabel="step", ylabel="loss")
    ax_time.set(title="step time", xlabel="step", ylabel="seconds")
    ax_loss.legend()
    ax_time.legend()
    with fsspec.open(url, "wb") as f:
        fig.savefig(f, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)


def release_pins(gate: GateConfig, step: int, arms: dict[str, TrainConfig]) -> list[str]:
    """Release the pins ``gate`` and its arms hold on the run's checkpoint at ``step`` (others' pins on
    it stay); returns the holders whose pin was released. A store that refuses is logged, not raised:
    the verdict stands, and ``marin checkpoints`` lists the pin that remains."""
    released = []
    for by in (gate.output_path, *(cfg.output_path for cfg in arms.values())):
        try:
            if unpin_checkpoint(gate.run, step, by):
                released.append(by)
        except Exception as e:  # noqa: BLE001 - every storage library's error means "not released now"
            logger.warning("gate %s: could not release its pin on %s (%s); the checkpoint stays until it is "
                           "removed by hand", gate.output_path, Run(gate.run).checkpoint_path(step), e)
    return released


def run_gate(gate: GateConfig, *, use_ray: bool | None = None) -> dict[str, Any]:
    """Run (or resume) every arm of ``gate`` and write ``gate.json`` and ``gate.png``; returns the
    verdict. What cannot be gated is refused (:class:`marin.training.gate.GateRefused`) before any
    arm starts. The gated checkpoint is pinned from before the first arm starts until the verdict is
    written (see the module's docstring)."""
    import ray  # Ray: only to launch on a pool, as the trainer does

    run = Run(gate.run)
    if not run.exists:
        raise FileNotFoundError(f"gate: no run at {gate.run}")
    step = run.step(gate.at_step)  # FileNotFoundError naming the committed steps
    base = run.config(step)
    arms = arm_configs(gate, base)
    pool = as_pool(arms[CONTROL].pool)
    run_name = base.telemetry.run_name or gate.run.rstrip("/").rsplit("/", 1)[-1]
    wandb = ({"project": base.telemetry.wandb_project, "group": run_name,
              "name": f"{run_name}/gate-{gate.output_path.rstrip('/').rsplit('/', 1)[-1]}"}
             if base.telemetry.wandb_project else None)
    on_ray = use_ray if use_ray is not None else ray.is_initialized()
    # one pin for the whole gate: the run's retention must not delete the checkpoint between two arms
    pin_checkpoint(gate.run, step, by=gate.output_path, role="gate")
    for label, cfg in arms.items():
        args = (cfg, gate.end_step, label, wandb)
        if on_ray:
            launch(pool, train_arm, args, step_dir=cfg.output_path, stall=cfg.stall)
        else:
            run_local(pool, train_arm, args)
    summaries = {label: arm_summary(read_metrics(cfg.output_path), _read_json(f"{cfg.output_path}/{ARM_FILE}") or {})
                 for label, cfg in arms.items()}
    note = check_pool(base.pool, gate.pool)
    doc = gate_report(gate, summaries, checkpoint=run.checkpoint_path(step), pool_note=note, changes=gate.candidates)
    out = gate.output_path.rstrip("/")
    _write_json(f"{out}/{GATE_FILE}", doc)
    write_plot(doc, f"{out}/{GATE_PLOT}")
    release_pins(gate, step, arms)
    logger.info("gate %s: %s", out, doc["verdict"])
    return {"verdict": doc["verdict"], "passed": doc["passed"], "failed": doc["failed"]}

