"""Arguments several commands share, spelled and documented once."""

from __future__ import annotations

import argparse
import sys
from typing import Any

PREFIX_HELP = "output prefix (default: $MARIN_PREFIX, else ./local_store)"


def add_prefix(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefix", help=PREFIX_HELP)


def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output (one JSON document)")


def add_address(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=None,
                        help="Ray cluster to run a pool of several hosts on (default: $RAY_ADDRESS; without one, a "
                             "local CPU pool's hosts are simulated as nodes on this machine)")


def add_refresh(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    parser.add_argument("--count", type=int, default=None,
                        help="stop after this many refreshes (default: until Ctrl-C)")


POOLS_HELP = ("a TOML file of your own device pools ([pools.NAME] tables of PoolSpec's fields, the form of "
              "marin/pools/pools.toml), known by name beside marin's; $MARIN_POOLS (FILE[:FILE...]) is read too; "
              "may be given more than once")


def add_pools(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pools", action="append", default=[], metavar="FILE", help=POOLS_HELP)


def use_pools(args: argparse.Namespace, command: str) -> bool:
    """Declare the pools of ``--pools`` (and ``$MARIN_POOLS``) in this process (the steps it declares
    carry their pools' specs to the processes that run them); False, with the one-line error printed,
    for a bad file (it names the file and the field)."""
    # the pool inventory brings the execution package (storage, the Ray cluster helpers): only the
    # commands that take --pools pay for it
    from marin.pools import PoolsFileError, use_pools_files

    try:
        use_pools_files(args.pools)
    except PoolsFileError as e:
        print(f"{command}: error: {e}", file=sys.stderr)
        return False
    return True


def _positive(text: str, kind: type, what: str) -> Any:
    """``text`` read as ``kind`` if it is a positive finite number, else the argparse error naming ``what``."""
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return value


def positive_int(text: str) -> int:
    """An argparse ``type`` for counts and sizes: 0 or a negative value is refused (not read as a default)."""
    return _positive(text, int, "a positive whole number")


def positive_float(text: str) -> float:
    """An argparse ``type`` for positive amounts (tokens, rates)."""
    return _positive(text, float, "a positive number")


def fraction(text: str) -> float:
    """An argparse ``type`` for a fraction in (0, 1] (an MFU)."""
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1], got {text}")
    return value
