"""Fixtures of the review tests (builders in review_fixtures.py, shared with benchmarks/report_bench.py)."""

from __future__ import annotations

import pytest
from review_fixtures import build_small


@pytest.fixture
def small_experiment(tmp_path):
    prefix = str(tmp_path / "store")
    return prefix, build_small(prefix)
