"""Arguments several commands share, spelled and documented once."""

from __future__ import annotations

import argparse

PREFIX_HELP = "output prefix (default: $MARIN_PREFIX, else ./local_store)"


def add_prefix(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefix", help=PREFIX_HELP)


def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output (one JSON document)")


def add_refresh(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    parser.add_argument("--count", type=int, default=None,
                        help="stop after this many refreshes (default: until Ctrl-C)")
