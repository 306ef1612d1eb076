"""``marin status --prefix P --watch``: what a running pipeline is doing, refreshed in place.

Per step: status (a RUNNING step whose lease holder is gone reads INTERRUPTED, with what to do),
lease holder and heartbeat age; for a training step its latest step of the configured total, loss,
tokens/s and an ETA, read from the tail of its ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, TextIO

from marin.execution import status as st
from marin.execution import storage
from marin.execution.prefix import resolve_prefix
from marin.review.steps import describe_prefix, row_for, step_dirs, train_horizon
from marin.textfmt import format_duration

TAIL_BYTES = 64 * 1024


def last_train_records(step_dir: str, n: int = 2) -> list[dict[str, Any]]:
    """The last ``n`` training records of a step's metrics.jsonl (reads only the file's tail locally)."""
    path = f"{step_dir}/metrics.jsonl"
    if storage.is_local(path):
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - TAIL_BYTES))
                text = f.read().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return []
        lines = text.splitlines()[1:] if size > TAIL_BYTES else text.splitlines()
    else:
        lines = (storage.read_text(path) or "").splitlines()
    out = []
    for line in reversed(lines):
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written right now
        if r.get("kind", "train") == "train" and "step" in r:
            out.append(r)
            if len(out) == n:
                break
    return out[::-1]


def eta_seconds(records: list[dict[str, Any]], horizon: int | None) -> float | None:
    """Seconds left at the latest throughput: tokens per step (from the last two records) / tokens/s."""
    if not records or not horizon:
        return None
    last = records[-1]
    tps = last.get("tokens_per_s")
    if len(records) >= 2 and "tokens" in last and records[-2].get("tokens") is not None:
        steps = last["step"] - records[-2]["step"]
        per_step = (last["tokens"] - records[-2]["tokens"]) / steps if steps else None
    else:
        per_step = last.get("tokens") / last["step"] if last.get("tokens") and last["step"] else None
    if not tps or not per_step:
        return None
    return max(0, horizon - last["step"]) * per_step / tps


def snapshot(prefix: str | None = None, now: float | None = None) -> tuple[str, bool]:
    """The status screen of every step under ``prefix`` and whether any step is still running."""
    prefix = resolve_prefix(prefix)
    now = time.time() if now is None else now
    dirs = step_dirs(prefix)
    if not dirs:
        return describe_prefix(prefix), False
    lines = [f"{prefix}  ({time.strftime('%H:%M:%S', time.localtime(now))})"]
    counts: dict[str, int] = {}
    running = False
    for d in dirs:
        row = row_for(d)
        key = row["label"].split(" ")[0]
        counts[key] = counts.get(key, 0) + 1
        if row["category"] not in ("running", "interrupted"):
            continue
        running |= row["category"] == "running"
        holder = row["lease_holder"] or "no holder"
        age = f", heartbeat {row['lease_age_s']:.0f}s ago" if row["lease_age_s"] is not None else ""
        lines.append(f"{row['label']:<12} {row['name']}-{row['hash']}  [{holder}{age}]")
        records = last_train_records(d)
        if records:
            horizon = train_horizon((st.read_info(d) or {}).get("config"))
            r = records[-1]
            of = f"/{horizon} ({100 * r['step'] / horizon:.1f}%)" if horizon else ""
            lines.append(f"             step {r['step']}{of}  loss {r.get('loss', float('nan')):.4f}  "
                         f"{r.get('tokens_per_s', 0):.0f} tok/s  eta {format_duration(eta_seconds(records, horizon))}")
        if row["advice"]:
            lines.append(f"             what to do: {row['advice']}")
    lines.append(", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    return "\n".join(lines), running


def watch(prefix: str | None = None, interval: float = 2.0, count: int | None = None,
          stream: TextIO | None = None) -> int:
    """Print :func:`snapshot` every ``interval`` seconds (``count`` times, default until Ctrl-C)."""
    stream = stream or sys.stdout
    clear = "\x1b[H\x1b[2J" if stream.isatty() else ""
    i = 0
    try:
        while count is None or i < count:
            text, _ = snapshot(prefix)
            stream.write(clear + text + "\n" + ("" if clear else "\n"))
            stream.flush()
            i += 1
            if count is None or i < count:
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
    return 0
