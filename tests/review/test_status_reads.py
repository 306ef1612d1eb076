"""``marin status`` reads each step's status file and lease once (one round trip each on an object
store), counted through an fsspec filesystem that wraps fsspec's in-memory one and counts reads."""

from __future__ import annotations

import collections

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from marin.cli import main as marin
from marin.execution import lease as leases
from marin.execution import status as st
from marin.execution.status import StepStatus
from marin.review.stepdir import Step


class CountingFileSystem(MemoryFileSystem):
    """fsspec's memory filesystem under ``countfs://``, counting whole-file reads by path."""

    protocol = "countfs"
    reads: collections.Counter = collections.Counter()

    def cat_file(self, path, start=None, end=None, **kwargs):
        CountingFileSystem.reads[path] += 1
        return super().cat_file(path, start=start, end=end, **kwargs)


@pytest.fixture
def prefix():
    fsspec.register_implementation("countfs", CountingFileSystem, clobber=True)
    root = "countfs://status-reads"
    holder = leases.new_holder_id()
    info = {"name": "x", "hash": "0"}
    for name, final in (("done", StepStatus.SUCCESS), ("broke", StepStatus.FAILED), ("busy", None)):
        step = f"{root}/{name}-0123456789"
        lease = leases.try_acquire(step, holder, info={**info, "name": name})
        st.write_status(step, StepStatus.RUNNING, lease=lease)
        if final is StepStatus.SUCCESS:  # as the executor commits: the lease goes with the write
            st.write_status(step, final, lease=lease, consume=leases.lease_path(step))
        elif final is not None:
            st.write_status(step, final, lease=lease, message="boom")
            leases.release(step, lease)
    # a step whose holder took the lease and has not written its status yet
    leases.try_acquire(f"{root}/starting-0123456789", holder, info={**info, "name": "starting"})
    yield root
    store = fsspec.filesystem("countfs").store
    for key in [k for k in store if k.startswith(root)]:
        del store[key]


def test_marin_status_reads_each_status_and_lease_once(prefix, capsys):
    CountingFileSystem.reads.clear()
    assert marin(["status", "--prefix", prefix]) == 0
    out = capsys.readouterr().out
    assert "done" in out and "broke" in out and "busy" in out and "starting" in out
    reads = dict(CountingFileSystem.reads)
    for name in ("done", "broke", "busy", "starting"):
        assert reads.get(f"{prefix}/{name}-0123456789/{st.STATUS_FILE}", 0) <= 1, reads
    assert reads[f"{prefix}/done-0123456789/{st.STATUS_FILE}"] == 1  # a finished step: its lease is gone
    for name in ("broke", "busy", "starting"):
        assert reads[f"{prefix}/{name}-0123456789/{leases.LEASE_FILE}"] == 1, reads
    assert max(reads.values()) == 1, reads  # nor any other file (a running step's pool placement) twice

    # the notebook API's Step reads them once too, whatever it is asked
    CountingFileSystem.reads.clear()
    steps = {n: Step(f"{prefix}/{n}-0123456789") for n in ("done", "broke", "busy", "starting")}
    assert {n: (s.status, s.state.category, s.name) for n, s in steps.items()} == {
        "done": ("SUCCESS", "succeeded", "done"), "broke": ("FAILED", "failed", "broke"),
        "busy": ("RUNNING", "running", "busy"), "starting": ("RUNNING", "running", "starting")}
    assert max(CountingFileSystem.reads.values()) == 1, CountingFileSystem.reads
