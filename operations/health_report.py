"""Health report of a training run from its metrics.jsonl: ``marin health`` (see ``marin health --help``).

    python operations/health_report.py ARGS...   is the same as   marin health ARGS...
"""

import sys

from marin.cli import main

if __name__ == "__main__":
    sys.exit(main(["health", *sys.argv[1:]]))
