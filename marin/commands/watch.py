"""Live status of the steps under a prefix (``marin status --watch``).

Refreshes in place while a pipeline runs: per step its status, lease holder and heartbeat age; for a
training step its progress, loss, tokens/s and ETA.
"""

from __future__ import annotations

import argparse

from marin.commands import options
from marin.review.live import watch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_prefix(parser)
    options.add_refresh(parser)


def run(args: argparse.Namespace) -> int:
    return watch(args.prefix, args.interval, args.count)
