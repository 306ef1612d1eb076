"""Re-plan the LR horizon of a running training step: ``marin replan-lr`` (see ``marin replan-lr --help``).

    python operations/replan_lr.py ARGS...   is the same as   marin replan-lr ARGS...
"""

import sys

from marin.cli import main

if __name__ == "__main__":
    sys.exit(main(["replan-lr", *sys.argv[1:]]))
