"""Training telemetry: ``metrics.jsonl`` in the step directory, W&B (offline by default), progress line.

The keys are the project's telemetry contract (docs/training.md, "Telemetry"), so monitoring, the
health report and the ladder fits can read any run the same way. MFU is a pure function of
throughput, the model's FLOPs per token and the pool's peak FLOP rate; the peak table lives here so
that every report uses the same denominators.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any, TextIO

import fsspec
from fsspec.implementations.local import LocalFileSystem

from marin.execution.retry import Outage, call_with_retry
from marin.textfmt import format_duration

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"

# Keys every logged step carries (the telemetry contract, with the router/expert-load summary).
METRIC_KEYS = (
    "step",
    "tokens",
    "loss",
    "ce_loss",
    "z_loss",
    "grad_norm",
    "lr",
    "drop_frac_send",
    "drop_frac_recv",
    "expert_load_max",
    "expert_load_mean",
    "router_bias_spread",
    "tokens_per_s",
    "mfu",
    "seq_len",
    "batch_size",
    "transport",
)

# Dense bf16 peak FLOP/s per device. CPU is a nominal figure for one fake device (a fraction of a
# core on this 2-core machine), so CPU MFU numbers are only comparable with each other.
PEAK_FLOPS_PER_DEVICE: dict[str, float] = {
    "GB200": 2.5e15,
    "B200": 2.25e15,
    "H200": 9.89e14,
    "H100": 9.89e14,
    "A100": 3.12e14,
    "cpu": 5.0e10,
}


def peak_flops_per_device(accelerator: str) -> float:
    try:
        return PEAK_FLOPS_PER_DEVICE[accelerator]
    except KeyError:
        raise KeyError(f"unknown accelerator {accelerator!r}; known: {sorted(PEAK_FLOPS_PER_DEVICE)}") from None


def mfu(tokens_per_s: float, train_flops_per_token: float, num_devices: int, peak_per_device: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the pool's peak FLOP/s (a fraction, not %).

    ``train_flops_per_token`` is forward + backward, i.e. ``marin.models.config.flops_per_token``.
    """
    if num_devices <= 0 or peak_per_device <= 0:
        raise ValueError("num_devices and peak_per_device must be positive")
    return tokens_per_s * train_flops_per_token / (num_devices * peak_per_device)


def _is_local(fs: Any) -> bool:
    return isinstance(fs, LocalFileSystem)


class MetricsWriter:
    """Appends one JSON object per logged step to ``{output_path}/metrics.jsonl``.

    On resume, lines for steps after the restored checkpoint are dropped: the resumed run logs those
    steps again, and a reader must never see two different values for one step. Local files are
    appended and flushed per line; object stores have no append, so the whole (small) file is
    rewritten at each ``flush``; through a store outage shorter than the retry limit the lines stay
    buffered and training goes on (:mod:`marin.execution.retry`).
    """

    def __init__(self, output_path: str, *, resume_step: int | None = None, is_writer: bool = True,
                 flush_every: int = 1) -> None:
        self.url = f"{output_path.rstrip('/')}/{METRICS_FILE}"
        self.fs, self.path = fsspec.core.url_to_fs(self.url)
        self.is_writer = is_writer
        self.flush_every = flush_every
        self._lines: list[str] = []
        self._pending = 0
        self._local = _is_local(self.fs)
        self._outage = Outage(f"write {self.url}")
        self._next_try = 0.0
        if not is_writer:
            return
        previous = read_metrics(self.url, kind=None) if self.fs.exists(self.path) else []
        keep_until = -1 if resume_step is None else resume_step
        self._lines = [json.dumps(r, sort_keys=True) for r in previous if r.get("step", -1) <= keep_until]
        self.fs.makedirs(self.path.rsplit("/", 1)[0], exist_ok=True)
        call_with_retry(self._rewrite, what=f"write {self.url}")

    def _rewrite(self) -> None:
        self.fs.pipe_file(self.path, "".join(line + "\n" for line in self._lines).encode())

    def _try_rewrite(self) -> bool:
        """One attempt to write every buffered line; False while the store is out (within the limit).

        The file is rewritten whole, so lines buffered through an outage land in order and once,
        with the next successful write; an outage past the retry limit raises
        :class:`StorageUnavailable` with the store's error (the step fails with the real cause)."""
        if self._outage.active and time.monotonic() < self._next_try:
            return False
        try:
            self._rewrite()
        except Exception as e:  # noqa: BLE001 - classified by the retry policy; others re-raised
            self._next_try = time.monotonic() + self._outage.failed(e)
            return False
        self._outage.succeeded()
        return True

    def log(self, record: Mapping[str, Any]) -> None:
        if not self.is_writer:
            return
        line = json.dumps(_jsonable(record), sort_keys=True)
        self._lines.append(line)
        if self._local:
            with open(self.path, "a") as f:
                f.write(line + "\n")
        else:
            self._pending += 1
            if self._pending >= self.flush_every:
                self.flush()

    def flush(self) -> None:
        """Write what is buffered; during a store outage the lines stay buffered (see :meth:`_try_rewrite`)."""
        if self.is_writer and not self._local and self._pending and self._try_rewrite():
            self._pending = 0

    def close(self) -> None:
        """Flush, waiting out an outage for what is left of the retry limit."""
        if not (self.is_writer and not self._local and self._pending):
            return
        while not self._try_rewrite():
            time.sleep(max(0.0, min(self._next_try - time.monotonic(), self._outage.remaining_s())) + 0.01)
        self._pending = 0


def _jsonable(record: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in record.items():
        if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
            v = v.item()
        if isinstance(v, float) and not math.isfinite(v):
            v = str(v)  # JSON has no NaN; keep the fact visible as a string
        out[k] = v
    return out


def read_metrics(url: str, kind: str | None = "train") -> list[dict[str, Any]]:
    """Records of a metrics.jsonl (path of the file or of the step directory holding it).

    Training steps and in-training evaluations are separate records; a record's ``kind`` is "eval"
    for the latter and absent (= "train") for the former. ``kind`` selects one of them (default: the
    training records, what throughput, health and phase summaries read); None returns every record.
    """
    if not url.rstrip("/").endswith(METRICS_FILE):
        url = f"{url.rstrip('/')}/{METRICS_FILE}"
    with fsspec.open(url, "r") as f:
        lines = [line for line in f if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1 and not line.endswith("\n"):
                break  # a live run is writing this line right now: read it next time
            raise
    return records if kind is None else [r for r in records if r.get("kind", "train") == kind]


def phase_summary(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop fraction and throughput per schedule phase (seq_len x transport), in order of appearance.

    The first record of each phase is left out of the throughput mean: it includes compilation.
    """
    groups: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for r in sorted(records, key=lambda r: r["step"]):
        groups.setdefault((r.get("seq_len"), r.get("transport")), []).append(r)
    out = []
    for (seq_len, transport), rs in groups.items():
        timed = rs[1:] or rs

        def mean(key: str, rows: list[dict[str, Any]]) -> float:
            vals = [float(x[key]) for x in rows if isinstance(x.get(key), (int, float))]
            return sum(vals) / len(vals) if vals else float("nan")

        out.append({
            "seq_len": seq_len,
            "transport": transport,
            "first_step": rs[0]["step"],
            "last_step": rs[-1]["step"],
            "drop_frac_send": mean("drop_frac_send", rs),
            "drop_frac_recv": mean("drop_frac_recv", rs),
            "tokens_per_s": mean("tokens_per_s", timed),
            "mfu": mean("mfu", timed),
        })
    return out


class WandbTracker:
    """W&B run with the same keys as metrics.jsonl; offline unless the user set ``WANDB_MODE``.

    The run id derives from the output path, so a resumed step continues the same W&B run; ``group``
    puts runs side by side in W&B (a gate's arms in their parent run's group). Its files
    live under the step directory (``{output_path}/wandb/``) on every backend: W&B writes through the
    local filesystem only, so for an object-store step it writes to a staging directory of this host
    named after the run, and :meth:`sync` copies what changed up to the step directory (the trainer
    calls it at every checkpoint, and :meth:`finish` at the end), so the files outlive the node.
    """

    def __init__(self, *, project: str, name: str, config: Mapping[str, Any], output_path: str,
                 run_id: str, local_dir: str | None = None, group: str | None = None) -> None:
        import wandb  # wandb: slow to import, only when a run logs to W&B

        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_SILENT", "true")
        fs, path = fsspec.core.url_to_fs(output_path)
        self._remote = None if _is_local(fs) else f"{output_path.rstrip('/')}/wandb"
        self._fs = fs
        self._synced: dict[str, tuple[float, int]] = {}
        staging = os.path.join(tempfile.gettempdir(), "marin-wandb", run_id)
        directory = local_dir or (path if self._remote is None else staging)
        os.makedirs(directory, exist_ok=True)
        self._run = wandb.init(
            project=project,
            name=name,
            group=group,
            id=run_id,
            resume="allow",
            dir=directory,
            config=dict(config),
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )
        self.dir = directory

    def log(self, record: Mapping[str, Any]) -> None:
        data = {k: v for k, v in _jsonable(record).items() if k != "step" and not isinstance(v, str)}
        self._run.log(data, step=int(record["step"]))

    def sync(self) -> int:
        """Copy the run's new or changed W&B files up to ``{output_path}/wandb/`` (object stores only;
        on local disk they are written there directly). Returns how many files were copied."""
        if self._remote is None:
            return 0
        root = os.path.join(self.dir, "wandb")
        copied = 0
        for folder, _, files in os.walk(root):
            for name in files:
                local = os.path.join(folder, name)
                try:
                    st = os.stat(local)
                except FileNotFoundError:  # W&B replaced it meanwhile
                    continue
                stamp = (st.st_mtime, st.st_size)
                if self._synced.get(local) == stamp:
                    continue
                remote = f"{self._remote}/{os.path.relpath(local, root)}"
                call_with_retry(functools.partial(self._fs.put_file, local, remote), what=f"copy W&B file to {remote}")
                self._synced[local] = stamp
                copied += 1
        return copied

    def finish(self, exit_code: int = 0) -> None:
        self._run.finish(exit_code=exit_code)
        self.sync()


class ProgressLine:
    """A periodic one-line summary (a progress bar would garble Ray's interleaved worker logs)."""

    def __init__(self, total_steps: int, *, every_s: float = 10.0, stream: TextIO | None = None) -> None:
        self.total = total_steps
        self.every_s = every_s
        self.stream = stream or sys.stderr
        self._last = -math.inf
        self._start = time.monotonic()
        self._start_step: int | None = None

    def update(self, record: Mapping[str, Any], *, force: bool = False) -> str | None:
        now = time.monotonic()
        step = int(record["step"])
        if self._start_step is None:
            self._start_step, self._start = step, now
        if not force and now - self._last < self.every_s:
            return None
        self._last = now
        done = step - self._start_step
        rate = done / (now - self._start) if now > self._start and done else 0.0
        eta = (self.total - step) / rate if rate else float("nan")
        line = (
            f"step {step}/{self.total} ({100.0 * step / max(1, self.total):.1f}%) "
            f"loss {record['loss']:.4f} lr {record['lr']:.3g} gnorm {record['grad_norm']:.3f} "
            f"drop {100 * record['drop_frac_send']:.2f}%/{100 * record['drop_frac_recv']:.2f}% "
            f"L={record['seq_len']} {record['transport']} {record['tokens_per_s']:.0f} tok/s "
            f"mfu {100 * record['mfu']:.2f}% eta {format_duration(eta)}"
        )
        print(line, file=self.stream, flush=True)
        return line
