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
