"""Rewrite a run's checkpoints of the earlier single-blob format in the sharded format.

Checkpoints of the earlier format (one ``arrays.bin`` per step, written by one process) restore as
they are; this converts them in place (the sharded copy is committed before the blob is deleted),
so later restores read each process's slices instead of the whole blob.
"""

from __future__ import annotations

import argparse

from marin.inference.run import committed_run_steps
from marin.training.checkpoint.legacy import convert_legacy


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="a training step's output directory (local path, s3:// or gs://)")


def run(args: argparse.Namespace) -> int:
    committed = committed_run_steps(args.run)  # no such directory, or no checkpoint in it: one line, status 2
    steps = convert_legacy(args.run)
    print(f"converted {len(steps)} checkpoint(s): {steps}" if steps else
          f"nothing to convert: the run's committed checkpoints {committed} are all in the sharded format")
    return 0
