"""The hash of every step of the shipped experiments, pinned.

A step's hash names its output directory, so a refactor that changes one (a field that moved in or
out of the version, an encoding change, a default that changed) silently re-runs that step and
everything downstream of it for every user. ``pinned_step_hashes.json`` holds the hashes as planned
offline (``--dry_run``-style planning; no data read, nothing run). When a change is meant to move a
hash (a field was wrongly left out of the version), regenerate the file with
``python tests/experiments/test_pinned_hashes.py`` and say in the commit which field and why.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PINNED = Path(__file__).with_name("pinned_step_hashes.json")
EXPERIMENTS = ("tutorial", "quickstart", "tiny_ladder", "tiny_isoflop", "ladder", "hero", "harrier_k40",
               "k40_from_raw")

pytestmark = pytest.mark.usefixtures("offline_k40")  # the experiment files, planned without their data


def planned_hashes(name: str) -> dict[str, str]:
    """Step name -> hash of one experiment file, planned under a fixed prefix (hashes do not depend on it)."""
    from marin.execution import plan_steps
    from marin.review.experiment_file import load_experiment

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the hero's does-not-fit-without-remat planning warning
        steps, _ = load_experiment(str(REPO / "experiments" / f"{name}.py"))
    return {s.name: s.hash for s in plan_steps(steps, "/pinned-prefix").steps}


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_step_hashes_of_the_shipped_experiments_do_not_move(name):
    pinned = json.loads(PINNED.read_text())[name]
    now = planned_hashes(name)
    moved = {n: f"{pinned.get(n)} -> {h}" for n, h in now.items() if pinned.get(n) != h}
    assert not moved and set(now) == set(pinned), f"step hashes of experiments/{name}.py moved: {moved}"


if __name__ == "__main__":  # regenerate the pins (only for a deliberate, explained hash change)
    import os

    os.environ["HARRIER_K40_ROOT"] = "s3://no-such-bucket-anywhere/k40"
    sys.path.insert(0, str(REPO))
    PINNED.write_text(json.dumps({n: planned_hashes(n) for n in EXPERIMENTS}, indent=1, sort_keys=True) + "\n")
