"""The frame every per-file corpus step runs in (tokenize, dedup, decontaminate): one error family,
the fan-out's grouping of small files, the corrupt-input check's message."""

from __future__ import annotations

import json
import os

import pytest

from marin.data import corpus_steps
from marin.data.corpus_steps import CorpusInput, CorpusStep, CorpusStepError, batches, run_tasks


def test_each_step_raises_its_own_error_of_the_one_family():
    from marin.data.decontaminate import STEP as DECONTAMINATE
    from marin.data.dedup import STEP as DEDUP
    from marin.data.tokenize import STEP as TOKENIZE

    steps = {s.name: s for s in (TOKENIZE, DEDUP, DECONTAMINATE)}
    assert sorted(steps) == ["decontaminate", "dedup", "tokenize"]
    assert len({s.error for s in steps.values()}) == 3 and all(issubclass(s.error, CorpusStepError)
                                                                 for s in steps.values())
    assert [s.manifest for s in steps.values()] == ["manifest.json", "dedup_manifest.json",
                                                    "decontamination_manifest.json"]


def _pid(task: int) -> dict:
    return {"task": task, "pid": os.getpid()}


@pytest.mark.usefixtures("ray_local")
def test_small_files_share_ray_tasks_but_every_cpu_gets_one():
    """Eight 10-byte files, far below min_task_bytes: grouped, yet into one Ray task per CPU slot of
    the cluster (4 here), not one task for all (which would leave the other CPUs idle)."""
    import sys

    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this module
    sizes = [10] * 8
    assert batches(sizes, min(64 << 20, sum(sizes) // 4)) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    results = run_tasks(_pid, list(range(8)), "test", CorpusInput(show_progress=False), sizes=sizes)
    assert [r["task"] for r in results] == list(range(8))  # in task order, whatever order the tasks finish in
    assert os.getpid() not in {r["pid"] for r in results}  # every group ran as a Ray task
    local = run_tasks(_pid, list(range(8)), "test", CorpusInput(show_progress=False, use_ray=False), sizes=sizes)
    assert {r["pid"] for r in local} == {os.getpid()}


def test_the_corrupt_input_check_names_every_failed_file_and_keeps_a_list(tmp_path):
    step = CorpusStep("probe", type("ProbeError", (CorpusStepError,), {}), "m.json", "probe_failures.json")
    results = [{"url": "/c/a.jsonl", "source": "a", "error": None, "corrupt": False},
               {"url": "/c/b.jsonl.gz", "source": "b", "error": "corrupt input file /c/b.jsonl.gz: EOFError: x",
                "corrupt": True},
               {"url": "/c/c.jsonl", "source": "c", "error": "OSError: gone", "corrupt": False}]
    assert step.check_failures(results[:2], str(tmp_path), "skip", 0.5) == [results[1]]  # within the budget
    with pytest.raises(step.error) as e:
        step.check_failures(results, str(tmp_path), "skip", 0.5, phase="write")
    assert str(e.value) == ("2 of 3 input files failed in the probe write step (finished work is kept; a rerun redoes "
                            "only what is missing):\n  corrupt input file /c/b.jsonl.gz: EOFError: x\n"
                            "  /c/c.jsonl: OSError: gone")
    listed = json.loads((tmp_path / "probe_failures.json").read_text())
    assert [f["input_file"] for f in listed] == ["/c/b.jsonl.gz", "/c/c.jsonl"]
    step.finish(str(tmp_path), {"ok": True})  # success: the manifest, and the stale failures list goes
    assert not (tmp_path / "probe_failures.json").exists() and (tmp_path / "m.json").exists()
    assert corpus_steps.WORK_DIR == "_work"
