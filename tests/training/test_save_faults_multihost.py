"""Failed saves of a two-host run (``local-2host``: two JAX processes joined by jax.distributed) on an
object store: the local S3 server behind a fault-injecting HTTP proxy on 127.0.0.1, which refuses or
holds chosen writes as a store does (a bucket policy denying a write, a host whose writes do not
arrive). Each failed save costs a save point, never the run: it finishes, every step once, and
resumes from the newest committed checkpoint."""

from __future__ import annotations

import http.client
import http.server
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from marin.pools import with_device_count
from marin.training import checkpoint as ckpt
from marin.training.checkpoint import CheckpointManager
from marin.training.metrics import read_metrics

HOST = Path(__file__).with_name("two_process_host.py")
REPO = HOST.parents[2]
sys.path.insert(0, str(HOST.parent))
from two_process_host import config  # noqa: E402  (the hosts' own config, so both sides agree)

DENIED = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code><Message>Access Denied'
          b'</Message></Error>')
_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade"}


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 in front of the S3 server. ``faults``: (method, key pattern,
    action, count): the first ``count`` requests that match are answered 403 AccessDenied
    (``"deny"``), held ``HOLD_S`` seconds before they go through (``"hold"``) or only recorded
    (``"see"``). Every other request goes through unchanged. ``hits`` records what matched."""

    # far past the hosts' part timeout (8 s) and the client's own patience (it gives the request up
    # and sends it again, held again while the fault's count lasts): the write does not arrive in time
    HOLD_S = 60.0

    def __init__(self, upstream: str, faults: list[tuple[str, str, str, int]]) -> None:
        self.upstream = upstream.removeprefix("http://")
        self.faults = [[m, re.compile(p), a, n] for m, p, a, n in faults]
        self.hits: list[tuple[str, str, str]] = []
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    data = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b""):
                                pass
                            return data
                        data += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _any(self) -> None:
                body = self._body()
                action = proxy.match(self.command, self.path)
                if action == "deny":
                    self.send_response(403)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(DENIED)))
                    self.end_headers()
                    self.wfile.write(DENIED)
                    return
                if action == "hold":
                    time.sleep(proxy.HOLD_S)
                conn = http.client.HTTPConnection(proxy.upstream, timeout=120)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP and k.lower() != "content-length":
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def match(self, method: str, path: str) -> str | None:
        with self.lock:
            for fault in self.faults:
                m, pattern, action, left = fault
                if left > 0 and m == method and pattern.search(path):
                    fault[3] -= 1
                    self.hits.append((method, path.split("?")[0], action))
                    return action
        return None

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_hosts(run: str, endpoint: str, timeout: float = 900) -> list[dict]:
    coord = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", AWS_ENDPOINT_URL=endpoint,
               AWS_ENDPOINT_URL_S3=endpoint, MARIN_STORAGE_RETRY_S="20", AWS_MAX_ATTEMPTS="1")
    env["XLA_FLAGS"] = with_device_count(env.get("XLA_FLAGS", ""), None)
    procs = [subprocess.Popen([sys.executable, str(HOST), "store", run, str(p), coord], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for p in range(2)]
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        results.append({"rc": p.returncode, "stderr": stderr, **(json.loads(lines[-1][7:]) if lines else {})})
    return results


@pytest.mark.slow  # two JAX processes train 12 steps; failed saves wait out the part timeout (8 s)
def test_a_two_host_run_rides_out_a_denied_commit_a_rejected_part_and_a_held_save(s3_bucket, s3_endpoint):
    """Step 2: the store denies process 0's COMMIT. Step 4: it refuses host 1's part record. Step 8:
    host 1's part record is held (every try of it) far past the part timeout; saves every 2 steps.
    Each save's outcome is process 0's one decision, which every host reads from the store: a failed
    save is one line on every host and counted, never the end of the run, and a host whose part is
    held abandons it once the save has failed, so the held part costs that one save and the next
    saves (10, 12) commit at their first try. Both hosts train all 12 steps (each logged once), the
    failed saves never commit, and the newest committed checkpoint restores."""
    steps = "checkpoints/step-{:08d}"
    proxy = FaultProxy(s3_endpoint, [
        ("PUT", re.escape(steps.format(2)) + r"/COMMIT", "deny", 1),
        ("PUT", re.escape(steps.format(4)) + r"/parts/process-00001", "deny", 1),
        ("PUT", re.escape(steps.format(8)) + r"/parts/process-00001", "hold", 10),
        ("PUT", r"step-000000(06|10|12)/COMMIT", "see", 10),
    ])
    run = f"{s3_bucket}/two"
    try:
        results = _two_hosts(run, proxy.url)
    finally:
        proxy.close()
    assert [r["rc"] for r in results] == [0, 0], [r["stderr"][-3000:] for r in results]
    assert [a for _, _, a in proxy.hits if a != "see"][:3] == ["deny", "deny", "hold"], proxy.hits
    # the saves after the held one commit at their first try (no retry of the final save either)
    commits = [int(re.search(r"step-(\d+)/COMMIT", p).group(1)) for _, p, a in proxy.hits if a == "see"]
    assert commits == [6, 10, 12], proxy.hits
    failed = []
    for r in results:
        failed.append([int(m.group(1)) for m in re.finditer(r"checkpoint save at step (\d+) failed", r["stderr"])])
        assert r["summary"]["final_step"] == 12, r["summary"]
        assert r["summary"]["checkpoint_failed_saves"] == len(failed[-1]), (r["summary"], failed[-1])
    assert failed[0] == failed[1] == [2, 4, 8], failed  # both hosts count the same failed saves
    assert results[0]["summary"]["final_loss"] == results[1]["summary"]["final_loss"]  # one run, two hosts
    err0, err1 = results[0]["stderr"], results[1]["stderr"]
    assert "step-00000002 failed on process 0: Access Denied" in err0  # the COMMIT refused
    assert "step-00000004: parts process-00001.json did not arrive within 8 s" in err0  # host 1's part refused
    # host 1 reads process 0's verdicts instead of waiting out its own timeout, and abandons its held part
    assert re.search(r"checkpoint save at step 2 failed .*process 0 gave it up .*Access Denied", err1), err1[-3000:]
    assert re.search(r"checkpoint save at step 8 failed .*process 0 gave it up .*did not arrive.*this process "
                     r"abandoned its unfinished writes", err1), err1[-3000:]
    mgr = CheckpointManager(f"{run}/run", config(f"{run}/run").checkpoint)
    assert mgr.committed_steps()[-1] == 12 and not set(mgr.committed_steps()) & {2, 4, 8}
    train = [r["step"] for r in read_metrics(f"{run}/run") if r.get("kind", "train") == "train"]
    assert train == list(range(1, 13))  # every step once, in order
    assert ckpt.read_checkpoint(f"{run}/run/checkpoints/step-00000012")[1]["data_step"] == 12
