"""The documentation's runnable examples run (a doc example that rots is worse than none)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _python_block(doc: str, first_line: str) -> str:
    text = (REPO / doc).read_text()
    for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        if block.startswith(first_line):
            return block
    raise AssertionError(f"{doc} has no python block starting with {first_line!r}")


def test_user_guide_first_experiment_runs_and_reruns_as_noop(tmp_path):
    script = tmp_path / "my_first.py"
    script.write_text(_python_block("docs/user-guide.md", "# experiments/my_first.py"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    cmd = [sys.executable, str(script), "--prefix", str(tmp_path / "store"), "--progress", "false"]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "Steps: 2 succeeded" in first.stderr
    [out] = (tmp_path / "store" / "my_first").glob("sum-*/sum.json")
    assert out.read_text() == '{"sum": %d}' % sum(range(10, 1000))
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert again.returncode == 0 and "Nothing to run: all 2 steps already succeeded" in again.stderr


def test_user_guide_review_in_python_runs(tmp_path):
    """The "From Python" example of the user guide, on a prefix holding every kind of step."""
    import importlib.util

    fixtures = sys.modules.get("review_fixtures")
    if fixtures is None:
        spec = importlib.util.spec_from_file_location("review_fixtures", REPO / "tests" / "review" / "review_fixtures.py")
        fixtures = sys.modules["review_fixtures"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(fixtures)
    fixtures.build_small(str(tmp_path / "local_store"))
    script = tmp_path / "review.py"
    script.write_text(_python_block("docs/user-guide.md", "# review in Python"))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "small/train" in r.stdout and "step 60 of 60" in r.stdout and "peak grad norm 4.0" in r.stdout
    assert "'ok': False" in r.stdout and "'macro_bpb': 1.315" in r.stdout
