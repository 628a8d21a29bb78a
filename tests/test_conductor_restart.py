"""Conductor replicas kept running. `make run` with two: both serve the one cluster, and a
replica killed outright (SIGKILL) mid-stream ends that stream with a closed connection at once
and is back within seconds, while the workers keep their processes and their registration.
Without engines: the cluster's own restart, and its giving up on a conductor that dies at
every start."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import wait_until
from test_launcher import _alive, _descendants

from cluster.ports import free_port
from cluster.shape import Shape
from embedded import ClusterSpec, EmbeddedCluster
from embedded.supervisor import GaveUp, RestartPolicy


@dataclass
class Launcher:
    proc: subprocess.Popen[str]
    urls: list[str]
    run_dir: Path
    lines: list[str] = field(default_factory=list)

    def printed(self) -> str:
        return "".join(self.lines)


def _drain(proc: subprocess.Popen[str], lines: list[str], banner: threading.Event) -> None:
    """Reads the launcher's output to its end (a full pipe would stop it)."""
    for line in proc.stdout:  # type: ignore[union-attr]
        lines.append(line)
        if "Ctrl-C stops every process" in line:
            banner.set()
    banner.set()


@pytest.fixture(scope="module")
def launcher(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    port = free_port()
    run_dir = tmp_path_factory.mktemp("replicas")
    short = tempfile.mkdtemp(prefix="kvc-test-")  # vLLM's socket paths: at most 107 bytes
    proc = subprocess.Popen(
        [sys.executable, "-m", "embedded", "--model", model_dir, "--port", str(port),
         "--run-dir", str(run_dir / "run"), "--admin-port", "0", "--both", "1", "--eager",
         "--conductors", "2"],
        env={**os.environ, "TMPDIR": short}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    banner = threading.Event()
    threading.Thread(target=_drain, args=(proc, lines, banner), daemon=True).start()
    try:
        assert banner.wait(300) and proc.poll() is None, "".join(lines[-30:])
        serving = next(ln for ln in lines if "kvcluster is serving" in ln)
        urls = re.findall(r"http://127\.0\.0\.1:\d+", serving)
        yield Launcher(proc, urls, run_dir / "run", lines)
        seen = _descendants(proc.pid)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0, "".join(lines[-30:])
        wait_until(lambda: not any(_alive(p) for p in seen), timeout=10.0,
                   what="processes left behind")
    finally:
        if proc.poll() is None:
            os.killpg(os.getpgid(proc.pid), signal.SIGKILL)
            proc.wait()
        shutil.rmtree(short, ignore_errors=True)


def _complete(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60,
                      json={"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0})


def _conductor_pid(launcher: Launcher, url: str) -> int | None:
    port = url.rsplit(":", 1)[1]
    for p in psutil.Process(launcher.proc.pid).children(recursive=True):
        try:
            argv = p.cmdline()
            if ("conductor" in argv and port in argv
                    and p.status() != psutil.STATUS_ZOMBIE):
                return p.pid
        except psutil.Error:
            continue
    return None


def _workers(launcher: Launcher) -> set[int]:
    """The worker front ends and their engines' processes."""
    out = set()
    for p in psutil.Process(launcher.proc.pid).children(recursive=True):
        try:
            argv = set(p.cmdline())
            if {"prefill_worker", "decode_worker"} & argv or p.name().startswith("VLLM::"):
                out.add(p.pid)
        except psutil.Error:
            continue
    return out


def _registrations(launcher: Launcher) -> dict[str, tuple[str, str]]:
    """Every worker's key in etcd: its (create revision, lease); the same pair later is the
    same registration, never renewed or made again."""
    etcd = json.loads((launcher.run_dir / "workers.json").read_text())["etcd"]
    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    reply = httpx.post(f"http://{etcd}/v3/kv/range", timeout=10, json={
        "key": b64("/kvcluster/instances/"), "range_end": b64("/kvcluster/instances0")}).json()
    return {base64.b64decode(kv["key"]).decode(): (kv["create_revision"], kv["lease"])
            for kv in reply.get("kvs", [])}


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.engine
def test_two_replicas_serve_the_one_cluster(launcher: Launcher):
    assert len(launcher.urls) == 2 and launcher.urls[0] != launcher.urls[1], launcher.urls
    for url in launcher.urls:
        r = _complete(url)
        assert r.status_code == 200, (url, r.text)
        assert r.json()["choices"][0]["text"]
        assert httpx.get(f"{url}/health", timeout=10).json()["routable"] == 1
    printed = launcher.printed()
    assert printed.count("conductorctl --addr") == 1 and "admin APIs:" in printed


@pytest.mark.engine
def test_a_conductor_killed_mid_stream_closes_it_and_is_back(launcher: Launcher):
    url, other = launcher.urls
    workers, registered = _workers(launcher), _registrations(launcher)
    assert workers and registered
    old = _conductor_pid(launcher, url)
    assert old is not None
    body = {"prompt": "Once upon a time", "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": True}
    chunks: list[str] = []
    with httpx.Client(timeout=httpx.Timeout(10.0)) as client, \
            client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                chunks.append(line)
            if len(chunks) >= 3:
                break
        os.kill(old, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(httpx.TransportError) as e:
            for line in lines:
                chunks.append(line)
        closed = time.monotonic() - killed
    assert not isinstance(e.value, httpx.TimeoutException), e.value
    assert closed < 5.0, closed
    assert "data: [DONE]" not in chunks  # the stream ended broken, not as a success

    assert _complete(other).status_code == 200  # the other replica serves meanwhile
    worker_log = launcher.run_dir / "both-0.log"  # and the engine stopped the stream's work
    wait_until(lambda: "request_aborted" in worker_log.read_text(errors="replace"),
               timeout=10.0, interval=0.2, what="the dead conductor's stream aborted")
    back = wait_until(lambda: _conductor_pid(launcher, url) not in (None, old)
                      and _healthy(url), timeout=30.0, interval=0.2,
                      what="the killed conductor back and healthy")
    r = _complete(url)
    assert r.status_code == 200, r.text
    assert _workers(launcher) == workers  # not one worker or engine process started again
    assert all(_alive(p) for p in workers)
    assert _registrations(launcher) == registered
    assert launcher.proc.poll() is None
    assert "child_restarted" in launcher.printed()  # the launcher's restart, not another
    print(f"stream closed {closed:.2f}s after the kill; conductor healthy again after "
          f"{time.monotonic() - killed:.1f}s ({back:.1f}s of waiting)")


def _no_engines(model_dir: str, run_dir: str, **kw) -> ClusterSpec:
    return ClusterSpec(model=model_dir, shape=Shape((), "no engines"), run_dir=run_dir, **kw)


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code in (200, 503)
    except httpx.HTTPError:
        return False


@pytest.mark.slow
def test_the_cluster_starts_a_killed_replica_again_and_leaves_the_other(model_dir, tmp_path):
    spec = _no_engines(model_dir, str(tmp_path / "run"), http_port=0, admin_port=0,
                       conductors=2)
    with EmbeddedCluster(spec) as c:
        assert len(set(c.urls)) == 2 and c.url == c.urls[0] and len(set(c.admin_addrs)) == 2
        assert c.admin_addr == c.admin_addrs[0]
        assert c.conductor is not None
        old, other = c.conductor.pid, c.conductors[1].child
        os.kill(old, signal.SIGKILL)

        def back() -> bool:
            c._check_alive(restart=True)
            return c.conductor is not None and c.conductor.pid != old and _answers(c.url)

        took = wait_until(back, timeout=30.0, interval=0.1, what="replica 0 back")
        assert c.conductors[0].restarts == 1 and c.conductors[1].restarts == 0
        assert c.conductors[1].child is other and _answers(c.urls[1])
        print(f"replica 0 answering again {took:.1f}s after the kill")


@pytest.mark.slow
def test_a_conductor_that_dies_at_every_start_is_given_up_on(model_dir, tmp_path):
    with socket.socket() as busy:  # its HTTP port taken: it exits at each start
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        spec = _no_engines(model_dir, str(tmp_path / "run"), http_port=busy.getsockname()[1],
                           admin_port=-1, conductor_restarts=RestartPolicy(
                               quick_deaths=2, backoff_s=0.1, max_backoff_s=0.1))
        c = EmbeddedCluster(spec)
        try:
            c.start(wait=False)
            with pytest.raises(GaveUp) as e:
                wait_until(lambda: c._check_alive(restart=True), timeout=60.0, interval=0.1)
        finally:
            c.stop()
    assert c.conductors == [] and "conductor exited 2 times in a row" in str(e.value)
    assert "address already in use" in str(e.value).lower(), str(e.value)
