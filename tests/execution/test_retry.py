"""The one retry policy for transient storage errors: what is retried, how long, and the final error."""

from __future__ import annotations

import errno
import logging

import pytest

from marin.execution.retry import Outage, RetryPolicy, StorageUnavailable, call_with_retry, default_policy, is_transient


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def test_backoff_doubles_up_to_its_cap():
    p = RetryPolicy(first_delay_s=0.5, max_delay_s=4.0, limit_s=100)
    assert [p.delay(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_which_errors_are_transient():
    import botocore.exceptions as bx

    assert is_transient(bx.EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert is_transient(ConnectionRefusedError(errno.ECONNREFUSED, "refused"))
    assert is_transient(OSError(errno.ETIMEDOUT, "timed out"))
    assert is_transient(OSError("503 Service Unavailable: SlowDown"))
    wrapped = RuntimeError("upload failed")
    wrapped.__cause__ = ConnectionResetError("reset by peer")
    assert is_transient(wrapped)
    for permanent in (FileNotFoundError("s3://nope/x"), PermissionError("AccessDenied"), OSError(errno.ENOSPC, "full"),
                      ValueError("bad json"), StorageUnavailable("already retried")):
        assert not is_transient(permanent), permanent


def test_a_short_outage_is_ridden_out_and_logged(caplog, monkeypatch):
    clock = FakeClock()
    calls = []

    def flaky():
        calls.append(clock.now)
        if len(calls) <= 3:
            raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
        return "ok"

    monkeypatch.setattr("marin.execution.retry.time.monotonic", clock)
    with caplog.at_level(logging.WARNING, logger="marin.execution.retry"):
        assert call_with_retry(flaky, what="write s3://b/x", policy=RetryPolicy(0.5, 10, 60),
                               sleep=clock.sleep) == "ok"
    assert clock.sleeps == [0.5, 1.0, 2.0]
    assert "write s3://b/x failed (ConnectionRefusedError: [Errno 111] Connection refused); attempt 1" in caplog.text
    assert "write s3://b/x succeeded again after 3.5s and 3 failed attempts" in caplog.text


def test_an_outage_counts_from_the_start_of_its_first_failed_attempt(caplog, monkeypatch):
    """A store client retries on its own before it raises (botocore about 5 s over a refused
    connection): the outage, its limit and its "succeeded again" line count that attempt's time too."""
    clock = FakeClock()
    calls = []

    def slow_to_fail():
        calls.append(clock.now)
        if len(calls) == 1:
            clock.now += 5.0  # the client's own retries, then its error
            raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
        return "ok"

    monkeypatch.setattr("marin.execution.retry.time.monotonic", clock)
    with caplog.at_level(logging.WARNING, logger="marin.execution.retry"):
        assert call_with_retry(slow_to_fail, what="read s3://b/x", policy=RetryPolicy(0.5, 10, 60),
                               sleep=clock.sleep) == "ok"
    assert "read s3://b/x succeeded again after 5.5s and 1 failed attempts" in caplog.text
    # past the limit: the first attempt's own 4 s count (failures at 4, 9, 14 s from its start; counted
    # from the first error instead, the third would end it "unreachable for 11s")
    clock.now, attempts = 0.0, []

    def down():
        attempts.append(clock.now)
        clock.now += 4.0
        raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")

    with pytest.raises(StorageUnavailable, match=r"unreachable for 14s over 3 attempts"):
        call_with_retry(down, what="read s3://b/x", policy=RetryPolicy(1, 4, 10), sleep=clock.sleep)


def test_an_outage_past_the_limit_fails_with_the_stores_error(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr("marin.execution.retry.time.monotonic", clock)

    def down():
        raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")

    with pytest.raises(StorageUnavailable) as e:
        call_with_retry(down, what="write s3://b/run/.executor_status", policy=RetryPolicy(1, 4, 10),
                        sleep=clock.sleep)
    assert str(e.value) == (
        "write s3://b/run/.executor_status: the store stayed unreachable for 10s over 5 attempts (retry limit 10s, "
        "$MARIN_STORAGE_RETRY_S); last error: ConnectionRefusedError: [Errno 111] Connection refused")
    assert isinstance(e.value.__cause__, ConnectionRefusedError)
    assert sum(clock.sleeps) == 10  # the last wait is cut to the limit


def test_permanent_errors_are_not_retried():
    calls = []

    def missing():
        calls.append(1)
        raise FileNotFoundError("s3://no-such-bucket/x")

    with pytest.raises(FileNotFoundError):
        call_with_retry(missing, what="read", sleep=lambda s: pytest.fail("slept"))
    assert calls == [1]


def test_outage_for_callers_that_must_not_block():
    clock = FakeClock()
    o = Outage("write metrics", RetryPolicy(1, 8, 5), clock=clock)
    assert o.remaining_s() == 5 and not o.active
    assert o.failed(TimeoutError()) == 1
    clock.now = 3
    assert o.failed(TimeoutError()) == 2 and o.remaining_s() == 2
    o.succeeded()
    assert not o.active and o.remaining_s() == 5
    o.failed(TimeoutError())
    clock.now = 9
    with pytest.raises(StorageUnavailable):
        o.failed(TimeoutError())


def test_the_limit_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("MARIN_STORAGE_RETRY_S", "2")
    assert default_policy().limit_s == 2.0
    monkeypatch.setenv("MARIN_STORAGE_RETRY_S", "soon")
    with pytest.raises(ValueError, match=r"\$MARIN_STORAGE_RETRY_S='soon' is not a number of seconds"):
        default_policy()


def test_capped_shortens_the_limit_inside_a_block_only(monkeypatch):
    from marin.execution.retry import capped

    monkeypatch.delenv("MARIN_STORAGE_RETRY_S", raising=False)
    assert default_policy().limit_s == 300
    with capped(10):
        assert default_policy().limit_s == 10
        with capped(30):  # an inner cap never lengthens an outer one
            assert default_policy().limit_s == 10
    assert default_policy().limit_s == 300


def test_tensorstore_errors_are_classified_by_what_they_say(tmp_path, monkeypatch):
    """Real tensorstore errors (it raises ValueError for every storage error): a refused connection to
    an S3 endpoint is transient, a missing array on local disk is not; the one-line form of the first
    keeps curl's words and leaves out the kilobytes of spec tensorstore appends."""
    import socket

    import tensorstore as ts

    from marin.training.checkpoint import kvstore_spec

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    quick = ts.Context({"s3_request_retries": {"max_retries": 1, "initial_delay": "0.01s", "max_delay": "0.01s"}})
    spec = {"driver": "zarr3", "kvstore": kvstore_spec("s3://nowhere/arr"),
            "metadata": {"shape": [4], "data_type": "float32"}}
    with pytest.raises(ValueError) as refused:
        ts.open(spec, create=True, open=True, context=quick).result()
    assert "curl_code='7'" in str(refused.value) and "tensorstore_spec" in str(refused.value)
    assert is_transient(refused.value)
    with pytest.raises(StorageUnavailable) as gave_up:
        call_with_retry(lambda: ts.open(spec, create=True, open=True, context=quick).result(), what="open arr",
                        policy=RetryPolicy(first_delay_s=0.01, limit_s=0.05), sleep=lambda s: None)
    last = str(gave_up.value).split("; last error: ")[1]
    assert last.startswith("ValueError: ABORTED: Error opening") and "Could not connect to server" in last
    assert "tensorstore_spec" not in last and len(last) < 320, last
    with pytest.raises(ValueError) as missing:
        ts.open({**spec, "kvstore": kvstore_spec(str(tmp_path / "none"))}, open=True).result()
    assert str(missing.value).startswith("NOT_FOUND") and not is_transient(missing.value)


def test_a_refused_connection_fails_at_once_where_a_person_waits_until_the_store_has_answered():
    from marin.execution.retry import refusal_fails_fast

    refused = RuntimeError("Could not connect to the endpoint URL")
    refused.__cause__ = ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
    assert is_transient(refused)  # a run rides it out: a frontend restarting
    with refusal_fails_fast():
        assert not is_transient(refused)  # nothing listens there
        assert is_transient(ConnectionResetError("reset by peer"))  # other connection errors as before
        calls = []

        def refuse():
            calls.append(1)
            raise refused

        with pytest.raises(RuntimeError):
            call_with_retry(refuse, what="list s3://b/x", sleep=lambda s: pytest.fail("slept"))
        assert calls == [1]
        assert call_with_retry(lambda: "ok", what="read s3://b/x") == "ok"
        assert is_transient(refused)  # the store answered once: now a refusal is an outage
    assert is_transient(refused)
