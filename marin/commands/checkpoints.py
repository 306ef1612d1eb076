"""A training run's checkpoints: size, tier, what pins each one, and what retention deletes next.

    marin checkpoints RUN                    # the table
    marin checkpoints RUN --prune --dry-run  # what retention would delete now
    marin checkpoints RUN --prune            # delete it (never a pinned or committed-and-kept one)

Retention follows the run's own recorded policy (``checkpoint.keep_last``, ``keep_every``,
``pinned_steps``), its transport handoffs and the pins other steps wrote (a branch's source, a gate
until its verdict). The
temporary tier (``checkpoint.temp_path``) is listed when the run has one; it keeps one checkpoint.

Each committed checkpoint's chunks are checked against its index from one listing (no data is read):
a chunk missing or not the size its shape and dtype give (a copy or write cut short) marks the
checkpoint DAMAGED, naming the array and chunk; ``marin sample``/``eval``/``export`` skip such a
checkpoint (their full check also verifies every chunk's checksum, which this one does not).
"""

from __future__ import annotations

import argparse

import fsspec

from marin.inference.run import committed_run_steps
from marin.textfmt import format_bytes, format_table
from marin.training.checkpoint import CheckpointManager
from marin.training.checkpoint.format import chunk_damage
from marin.training.planning import transport_handoffs
from marin.training.run import Run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="a training step's output directory (local path, s3:// or gs://)")
    parser.add_argument("--prune", action="store_true", help="delete what retention would delete now")
    parser.add_argument("--dry-run", action="store_true", help="with --prune: say what it would delete")


def _size(fs, path: str) -> int:
    try:
        return int(fs.du(path, total=True))
    except (FileNotFoundError, OSError):
        return 0


def _state(url: str) -> str:
    """"ok", or "DAMAGED: " and what is wrong with the checkpoint's stored chunks (:func:`chunk_damage`)."""
    problems = chunk_damage(url)
    return "ok" if not problems else "DAMAGED: " + "; ".join(problems[:2]) + (
        f"; {len(problems) - 2} more arrays" if len(problems) > 2 else "")


def run(args: argparse.Namespace) -> int:
    committed_run_steps(args.run)  # no such directory, or no checkpoint in it: one line, status 2
    config = Run(args.run).config()
    policy = config.checkpoint
    mgr = CheckpointManager(args.run, policy, temp_path=policy.temp_path, handoffs=transport_handoffs(config))
    plan = mgr.retention_plan()
    dirs = mgr.permanent.step_dirs()
    rows, total, damaged = [], 0, []
    for step, action in plan.items():
        size = _size(mgr.fs, dirs[step])
        total += size
        state = _state(mgr.permanent.url(step)) if mgr.permanent.is_committed(dirs[step]) else "-"
        damaged += [step] if state.startswith("DAMAGED") else []
        rows.append((f"{step:,}", "permanent", format_bytes(size), state, action))
    if mgr.temporary is not None:
        for step, path in sorted(mgr.temporary.step_dirs().items()):
            fs, _ = fsspec.core.url_to_fs(mgr.temporary.root_url)
            committed = mgr.temporary.is_committed(path)
            rows.append((f"{step:,}", "temporary", format_bytes(_size(fs, path)),
                         _state(mgr.temporary.url(step)) if committed else "-",
                         "keep: the rolling one" if committed else "delete: never committed"))
    print(format_table(("step", "tier", "size", "chunks", "retention"), rows, right=(0, 2)))
    doomed = [s for s, a in plan.items() if a.startswith("delete")]
    print(f"{len(plan)} permanent checkpoint(s), {format_bytes(total)}; retention deletes next: "
          + (", ".join(f"{s:,}" for s in doomed) if doomed else "nothing"))
    if damaged:
        print(f"{len(damaged)} damaged: {', '.join(f'{s:,}' for s in damaged)} (sample, eval and export skip it and "
              "use the newest one that verifies; a resumed run moves it aside)")
    if args.prune:
        if args.dry_run:
            print("dry run: nothing deleted" + (f" (would delete {len(doomed)})" if doomed else ""))
        else:
            deleted = mgr.collect_garbage()
            print(f"deleted {len(deleted)}: {', '.join(f'{s:,}' for s in deleted) or 'nothing'}"
                  + (f"; {len(doomed) - len(deleted)} could not be deleted (see the warning)"
                     if len(deleted) < len(doomed) else ""))
    return 0
