"""Status transitions, leases (expiry, takeover, fencing), secret masking."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from marin.execution import lease as leases
from marin.execution import status as st
from marin.execution.jsonable import is_secret_field, mask_leaves, to_jsonable
from marin.execution.status import IllegalTransition, StepStatus


def test_status_transitions():
    st.check_transition(None, StepStatus.RUNNING)
    st.check_transition(StepStatus.RUNNING, StepStatus.SUCCESS)
    st.check_transition(StepStatus.RUNNING, StepStatus.RUNNING)  # takeover after a crash
    st.check_transition(StepStatus.FAILED, StepStatus.RUNNING)
    for old, new in [(StepStatus.SUCCESS, StepStatus.RUNNING), (StepStatus.SUCCESS, StepStatus.FAILED),
                     (None, StepStatus.SUCCESS), (StepStatus.FAILED, StepStatus.SUCCESS)]:
        with pytest.raises(IllegalTransition):
            st.check_transition(old, new)


def test_status_file_keeps_event_history(tmp_path):
    """A held lease is the attempt in progress (no RUNNING write); each attempt's first write records it."""
    d = str(tmp_path / "step")
    a = leases.try_acquire(d, "h1", info={"config": {"lr": 1}})
    assert os.listdir(d) == [leases.LEASE_FILE]  # starting a step is one write
    assert st.read_status(d)["status"] == "RUNNING" and st.read_info(d) == {"config": {"lr": 1}}
    assert st.read_status(d, attempts=False) is None
    st.write_status(d, StepStatus.FAILED, lease=a, message="boom", info={**a.info, "error": "boom"})
    leases.release(d, a)
    assert st.read_status(d)["status"] == "FAILED"  # a released lease adds nothing
    assert st.read_info(d) == {"config": {"lr": 1}, "error": "boom"}
    b = leases.try_acquire(d, "h2", info={"config": {"lr": 2}})
    assert st.read_status(d)["status"] == "RUNNING" and st.read_info(d) == {"config": {"lr": 2}}
    rec = st.write_status(d, StepStatus.SUCCESS, lease=b, consume=leases.lease_path(d))
    assert rec["info"] == {"config": {"lr": 2}} and st.read_info(d) == rec["info"]
    assert rec == st.read_status(d) and rec["status"] == "SUCCESS"
    events = rec["events"]
    assert [(e["status"], e["holder"], e["token"]) for e in events] == [
        ("RUNNING", "h1", 1), ("FAILED", "h1", 1), ("RUNNING", "h2", 2), ("SUCCESS", "h2", 2)]
    assert events[0]["time"] == a.since and events[2]["time"] == b.since
    assert events[1]["message"] == "boom"


def _lease_of_dead_process(d: str, lease: leases.Lease) -> None:
    """Make ``lease``'s holder a process of this host that is gone (a crashed executor)."""
    with open(leases.lease_path(d), "w") as f:
        f.write(dataclasses.replace(lease, pid=_dead_pid()).to_json())


def test_attempts_of_dead_holders_stay_in_the_history(tmp_path):
    d = str(tmp_path / "step")
    a = leases.try_acquire(d, "A")
    _lease_of_dead_process(d, a)  # A dies mid-step: its lease was its only record
    b = leases.try_acquire(d, "B")
    assert b.abandoned == (a.attempt,)
    _lease_of_dead_process(d, b)  # and B too
    c = leases.try_acquire(d, "C")
    assert c.abandoned == (a.attempt, b.attempt)
    assert [(e["holder"], e["status"]) for e in st.read_status(d)["events"]] == [
        ("A", "RUNNING"), ("B", "RUNNING"), ("C", "RUNNING")]
    rec = st.write_status(d, StepStatus.SUCCESS, lease=c, consume=leases.lease_path(d))
    assert [(e["holder"], e["status"]) for e in rec["events"]] == [
        ("A", "RUNNING"), ("B", "RUNNING"), ("C", "RUNNING"), ("C", "SUCCESS")]
    assert st.attempt_times(rec)[1] == c.since

    # a holder that recorded its end (FAILED) and died before releasing is not shown twice
    d2 = str(tmp_path / "step2")
    a = leases.try_acquire(d2, "A")
    st.write_status(d2, StepStatus.FAILED, lease=a, message="boom")
    _lease_of_dead_process(d2, a)
    assert st.read_status(d2)["status"] == "FAILED"
    leases.try_acquire(d2, "B")
    assert [(e["holder"], e["status"]) for e in st.read_status(d2)["events"]] == [
        ("A", "RUNNING"), ("A", "FAILED"), ("B", "RUNNING")]


def test_with_attempts_against_the_obvious_rule():
    """Pure merge: one RUNNING event per recorded attempt that no event was written under."""
    lease = leases.Lease("B", 3, 99.0, "h", 1, since=50.0, abandoned=(("A", 2, 40.0),))
    assert st.with_attempts(None, None) is None
    assert st.with_attempts(None, dataclasses.replace(lease, released=True)) is None
    got = st.with_attempts(None, lease)
    assert got == {"status": "RUNNING", "events": [
        {"status": "RUNNING", "time": 40.0, "holder": "A", "token": 2},
        {"status": "RUNNING", "time": 50.0, "holder": "B", "token": 3}]}
    assert [e["holder"] for e in st.with_attempts(None, lease, own=False)["events"]] == ["A"]
    with_info = dataclasses.replace(lease, info={"name": "x"})
    assert st.with_attempts(None, with_info)["info"] == {"name": "x"}
    assert "info" not in st.with_attempts(None, with_info, own=False)
    failed_a = {"status": "FAILED", "events": [{"status": "RUNNING", "time": 40.0, "holder": "A", "token": 2},
                                              {"status": "FAILED", "time": 45.0, "holder": "A", "token": 2}]}
    assert [e["holder"] for e in st.with_attempts(failed_a, lease)["events"]] == ["A", "A", "B"]
    # an executor that wrote no tokens (and wrote RUNNING itself) is matched by its holder id
    legacy = {"status": "RUNNING", "events": [{"status": "RUNNING", "time": 50.0, "holder": "B"}]}
    assert st.with_attempts(legacy, dataclasses.replace(lease, abandoned=())) == legacy


def test_a_step_record_without_info_has_none(tmp_path):
    """The info lives in the one status record; a record that holds none (a step before it first
    started) has none, and its attempt times still read."""
    d = tmp_path / "step"
    d.mkdir()
    (d / st.STATUS_FILE).write_text(json.dumps({"status": "SUCCESS", "events": [
        {"status": "RUNNING", "time": 1.0, "holder": "h"}, {"status": "SUCCESS", "time": 2.0, "holder": "h"}]}))
    assert st.read_info(str(d)) is None and st.read_info(str(tmp_path / "never-started")) is None
    assert st.attempt_times(st.read_status(str(d)))[0] == 1.0


def test_success_consumes_the_lease_in_one_write(tmp_path):
    """The commit removes the lease with the SUCCESS write; on local disk the lease's file becomes the
    status file (no file is created), and a waiting executor then takes a fresh lease and reuses SUCCESS."""
    d = str(tmp_path / "step")
    lease = leases.try_acquire(d, "A")
    lease_inode = os.stat(leases.lease_path(d)).st_ino
    with leases.fenced(d, lease):
        st.write_status(d, StepStatus.SUCCESS, lease=lease, consume=leases.lease_path(d))
    assert st.read_status(d)["status"] == "SUCCESS" and leases.read_lease(d) is None
    assert os.stat(f"{d}/{st.STATUS_FILE}").st_ino == lease_inode
    assert sorted(os.listdir(d)) == [st.STATUS_FILE]  # no temporary file left behind
    with pytest.raises(leases.LeaseLost, match="now held by nobody"):  # a late heartbeat of A
        leases.renew(d, lease)
    assert leases.try_acquire(d, "B").token == 1
    # nothing to consume (a step recorded by hand): a plain write
    d2 = str(tmp_path / "step2")
    st.write_status(d2, StepStatus.DEP_FAILED, lease=lease, consume=leases.lease_path(d2))
    assert st.read_status(d2)["status"] == "DEP_FAILED"


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_is_stale_rules():
    host = socket.gethostname()
    now = time.time()
    live = leases.Lease("x", 1, now + 100, "elsewhere", 1)
    assert not leases.is_stale(live, now, host)
    assert leases.is_stale(live, now + 101, host)  # expired
    assert leases.is_stale(leases.Lease("x", 1, now + 100, "elsewhere", 1, released=True), now, host)
    assert leases.is_stale(leases.Lease("x", 1, now + 100, host, _dead_pid()), now, host)  # holder died here
    import os

    assert not leases.is_stale(leases.Lease("x", 1, now + 100, host, os.getpid()), now, host)


def test_lease_acquire_renew_release_with_monotonic_tokens(tmp_path):
    d = str(tmp_path / "s")
    a = leases.try_acquire(d, "A", ttl=30)
    assert a is not None and a.token == 1
    assert leases.try_acquire(d, "B", ttl=30) is None  # held by a live holder
    a2 = leases.renew(d, a, ttl=30)
    assert a2.token == 1 and a2.expiry >= a.expiry
    leases.release(d, a2)
    b = leases.try_acquire(d, "B", ttl=30)
    assert b is not None and b.token == 2


def test_stale_lease_is_taken_over_and_the_loser_is_fenced(tmp_path):
    d = str(tmp_path / "s")
    a = leases.try_acquire(d, "A", ttl=0.2)
    # a holder on another host that stopped heartbeating: only expiry frees it
    (tmp_path / "s" / ".executor_lease").write_text(json.dumps({**json.loads(a.to_json()), "host": "gone-host"}))
    assert leases.try_acquire(d, "B", ttl=30) is None
    time.sleep(0.25)
    b = leases.try_acquire(d, "B", ttl=30)
    assert b is not None and b.token == a.token + 1
    with pytest.raises(leases.LeaseLost, match="now held by B"):
        leases.renew(d, a)
    leases.release(d, a)  # the loser releasing must not free the winner's lease
    assert leases.read_lease(d).holder == "B" and not leases.read_lease(d).released


def test_dead_holder_on_this_host_is_replaced_immediately(tmp_path):
    d = tmp_path / "s"
    d.mkdir()
    dead = leases.Lease("ghost", 7, time.time() + 3600, socket.gethostname(), _dead_pid())
    (d / ".executor_lease").write_text(dead.to_json())
    got = leases.try_acquire(str(d), "me")
    assert got is not None and got.token == 8


def test_s3_lease_uses_conditional_writes(s3_bucket):
    d = f"{s3_bucket}/step-1"
    a = leases.try_acquire(d, "A", ttl=30)
    assert a is not None and leases.try_acquire(d, "B", ttl=30) is None
    from marin.execution import storage

    # a racer holding an old tag cannot overwrite
    text, tag = storage.read_with_tag(f"{d}/.executor_lease")
    leases.renew(d, a)
    assert not storage.compare_and_swap(f"{d}/.executor_lease", "{}", tag)
    assert not storage.compare_and_swap(f"{d}/.executor_lease", "{}", None)
    # a finished step's lease is removed; a renewal that read it before then loses quietly
    text, tag = storage.read_with_tag(f"{d}/.executor_lease")
    storage.remove(f"{d}/.executor_lease")
    assert not storage.compare_and_swap(f"{d}/.executor_lease", "{}", tag)
    with pytest.raises(leases.LeaseLost, match="now held by nobody"):
        leases.renew(d, a)
    assert leases.try_acquire(d, "B", ttl=30).token == 1


def test_secret_fields_are_masked():
    assert is_secret_field("api_key") and is_secret_field("wandbApiKey") and is_secret_field("hf_token")
    assert is_secret_field("password") and is_secret_field("aws_secret_access_key")
    assert not is_secret_field("tokenizer") and not is_secret_field("tokens_per_step") and not is_secret_field("monkey")
    out = to_jsonable({"api_key": "sk-123", "nested": {"db_password": "hunter2", "tokenizer": "bpe"}})
    assert out == {"api_key": "***", "nested": {"db_password": "***", "tokenizer": "bpe"}}
    assert mask_leaves({'auth["hf_token"]': "abc", "lr": 1}) == {'auth["hf_token"]': "***", "lr": 1}
