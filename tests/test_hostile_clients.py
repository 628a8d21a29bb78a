"""Slow and hostile clients against the real conductor app over fake workers: clients that
hold half-sent heads or bodies, stop reading their stream, or go away mid-body must not take
the conductor's slots, its event loop or its logs from everyone else."""

from __future__ import annotations

import socket
import time
from contextlib import ExitStack

import httpx
import pytest
from conftest import wait_until
from fake_worker import Knobs, LocalConductor

HEAD = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 100000\r\n\r\n{")
"""A request head announcing a 100 kB body, and its first byte."""


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _status(metrics: str, status: str) -> float:
    line = f'kvcluster_requests_total{{endpoint="completions",status="{status}"}} '
    return sum(float(x.split()[-1]) for x in metrics.splitlines() if x.startswith(line))


def test_clients_holding_half_sent_bodies_take_no_slot_and_their_disconnects_are_no_500(
        model_dir):
    """More idle clients than the conductor has request slots, each holding a body it never
    finishes: ordinary requests and /health are answered at once throughout, and when the
    idle clients go away each is one client-closed request, not an internal error."""
    n = 48
    with LocalConductor(model_dir, conductor_args=("--max-in-flight", "16")) as c, \
            ExitStack() as held:
        socks = [held.enter_context(_connect(c.url)) for _ in range(n)]
        for s in socks:
            s.sendall(HEAD)
        t0 = time.monotonic()
        r = httpx.post(f"{c.url}/v1/completions", timeout=5,
                       json={"prompt": "hello", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert httpx.get(f"{c.url}/health", timeout=1).status_code == 200
        assert time.monotonic() - t0 < 2.0
        held.close()  # every idle client disconnects mid-body
        metrics = lambda: httpx.get(f"{c.url}/metrics", timeout=1).text  # noqa: E731
        wait_until(lambda: _status(metrics(), "499") >= n, 10,
                   "the disconnects were not counted as client-closed requests")
        assert _status(metrics(), "500") == 0


def test_a_body_that_does_not_arrive_in_time_is_408(model_dir):
    with LocalConductor(model_dir, conductor_args=("--http-body-timeout-s", "0.5")) as c, \
            _connect(c.url) as s:
        s.sendall(HEAD)
        t0 = time.monotonic()
        answer = s.recv(4096)
        assert b" 408 " in answer.split(b"\r\n")[0], answer[:200]
        assert time.monotonic() - t0 < 5
        assert c.worker("decode").counts.generates == 0


def test_a_head_that_does_not_arrive_in_time_closes_the_connection(model_dir):
    with LocalConductor(model_dir, conductor_args=("--http-head-timeout-s", "0.5")) as c, \
            _connect(c.url) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")  # and never the rest
        t0 = time.monotonic()
        assert s.recv(4096) == b""  # closed by the server
        assert time.monotonic() - t0 < 5


def test_a_stream_whose_client_stopped_reading_is_aborted(model_dir):
    """A client that keeps its connection open but reads nothing: once the conductor cannot
    send for `--http-send-timeout-s`, the connection closes and the engine work is aborted."""
    knobs = Knobs(token_delay_s=0.0)
    with LocalConductor(model_dir, knobs=knobs, max_model_len=1 << 16,
                        conductor_args=("--http-send-timeout-s", "0.5")) as c:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        host, port = c.url.removeprefix("http://").split(":")
        s.connect((host, int(port)))
        body = (b'{"prompt": "x", "max_tokens": 60000, "stream": true, "logprobs": 20, '
                b'"ignore_eos": true}')
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                  b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        decode = c.worker("decode")
        try:
            wait_until(lambda: decode.counts.aborted >= 1, 30,
                       "the engine work of a stream nobody reads was not aborted")
        finally:
            s.close()


_LOG_AN_EXCEPTION = """
import structlog
from cluster.logging import configure
configure("test", json={json})

def fail(body):
    secret = "-".join((body, body[::-1]))  # a local a rich traceback would show
    raise ValueError("boom")

try:
    fail("prompt")
except ValueError:
    structlog.get_logger("t").exception("failed")
"""


@pytest.mark.parametrize("json_logs", [False, True])
def test_an_exception_logged_shows_no_local_variables(json_logs):
    """Log lines never render locals (request bodies, keys): a traceback is plain text. (In a
    process of its own: configuring logging here would bind this test's captured stderr into
    every logger for the rest of the session.)"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _LOG_AN_EXCEPTION.format(json=json_logs)],
                         capture_output=True, text=True, timeout=60)
    err = out.stderr
    assert out.returncode == 0 and "boom" in err and "ValueError" in err, err
    assert "prompt-tpmorp" not in err  # the local's value appears nowhere in the source
