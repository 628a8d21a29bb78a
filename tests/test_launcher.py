"""`make run`'s command: serves, answers curl-style requests, and Ctrl-C leaves no process."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from stat import S_ISSOCK

import httpx
import pytest
from conftest import wait_until

from cluster.ports import free_port


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _routable(port: int) -> int:
    return httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()["routable"]


def _engine_cores(pid: int) -> list[int]:
    return [p for p in _descendants(pid) if _comm(p).startswith("VLLM::EngineCor")]


def _complete(port: int) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                      json={"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0})


def _sockets(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if S_ISSOCK(p.lstat().st_mode)]


def _placed_as_the_shape_says(launcher: int) -> None:
    """The conductor on `Shape.conductor_cpus` (else the serving cores), every worker's front
    end, the replaced one too, on `Shape.serving_cpus` (none given: wherever)."""
    import psutil

    from cluster.instance import cpu_list
    from cluster.shape import choose, machine_cores

    plan = choose(machine_cores())
    if not plan.serving_cpus:
        return
    serving = cpu_list(plan.serving_cpus)
    placed: dict[str, list[frozenset[int]]] = {"front": [], "conductor": []}
    for p in psutil.Process(launcher).children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE or p.name().startswith("VLLM::"):
                continue
            argv = set(p.cmdline())
            kind = "front" if {"prefill_worker", "decode_worker"} & argv else (
                "conductor" if "conductor" in argv else "")
            if kind:
                placed[kind].append(frozenset(p.cpu_affinity()))
        except psutil.Error:  # gone meanwhile
            continue
    assert placed["front"] == [serving] * len(plan.engines)
    assert placed["conductor"] == [cpu_list(plan.conductor_home)]


@pytest.fixture
def short_tmp():
    """A temporary directory for the cluster's processes: vLLM makes its socket files there,
    and a socket's path has at most 107 bytes (pytest's `tmp_path` is too long)."""
    tmp = Path(tempfile.mkdtemp(prefix="kvc-test-"))
    yield tmp
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.engine
def test_launcher_serves_restarts_a_dead_engine_and_ctrl_c_leaves_nothing(model_dir, tmp_path,
                                                                         short_tmp):
    port = free_port()
    # started with SIGINT ignored, as background jobs are (and as this runner's children may
    # be): Ctrl-C must still stop it
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "embedded", "--model", model_dir, "--port",
             str(port), "--run-dir", str(tmp_path / "run"), "--admin-port", "0"],
            env={**os.environ, "TMPDIR": str(short_tmp)}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    finally:
        signal.signal(signal.SIGINT, old)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 300
        lines = []
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if "Ctrl-C stops every process" in line:
                break
            assert time.monotonic() < deadline, "".join(lines[-30:])
        assert proc.poll() is None, "".join(lines[-30:])
        printed = "".join(lines)
        assert f"curl http://127.0.0.1:{port}/v1/completions" in printed

        r = _complete(port)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        assert text

        # an engine core killed (as the OOM killer would): its worker leaves, the launcher
        # starts another in its place, and the cluster serves again with every engine
        engines = _routable(port)
        cores = _engine_cores(proc.pid)
        assert cores and engines == len(cores)
        os.kill(cores[0], signal.SIGKILL)
        wait_until(lambda: set(_engine_cores(proc.pid)) - set(cores)
                   and _routable(port) == engines, timeout=240, interval=1.0,
                   what="the killed engine replaced and routable again")
        assert _complete(port).status_code == 200
        assert _complete(port).json()["choices"][0]["text"] == text
        assert proc.poll() is None
        _placed_as_the_shape_says(proc.pid)

        seen = _descendants(proc.pid)
        assert len(seen) >= 4  # etcd, master, two workers, conductor (and engine cores)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0
        assert "worker_died" in proc.stdout.read()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            os.killpg(os.getpgid(proc.pid), signal.SIGKILL)
            proc.wait()
    wait_until(lambda: not any(_alive(p) for p in seen), timeout=5.0,
               what="processes left behind")
    assert _sockets(short_tmp) == []  # vLLM's, in each engine's directory (`worker.engine`)


@pytest.mark.engine
def test_a_launcher_killed_outright_leaves_no_process(model_dir, tmp_path, short_tmp):
    """SIGKILL (the OOM killer) runs no handler: the launcher's children die with it (their
    parent-death signal), and their engines' processes with them (`worker.vllm_plugin`), not
    left spinning."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "embedded", "--model", model_dir, "--port", str(port),
         "--run-dir", str(tmp_path / "run"), "--admin-port", "0", "--both", "1", "--eager"],
        env={**os.environ, "TMPDIR": str(short_tmp)}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen: set[int] = set()
    try:
        lines = []
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if "Ctrl-C stops every process" in line:
                break
        assert proc.poll() is None, "".join(lines[-30:])
        assert _complete(port).status_code == 200
        seen = _descendants(proc.pid)
        names = {_comm(p) for p in seen}
        assert {"VLLM::EngineCor", "VLLM::Worker"} <= names, names
        proc.kill()
        proc.wait()
        def left() -> list[str]:
            return sorted(f"{_comm(p)} ({p})" for p in seen if _alive(p))

        try:
            wait_until(lambda: not left(), timeout=30.0, interval=0.5)
        except AssertionError:
            raise AssertionError(f"processes left behind: {left()}") from None
    finally:
        for p in seen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_child_outlives_the_thread_that_started_it(tmp_path):
    """The parent-death signal follows the forking thread: children are forked from one
    long-lived thread, so a worker started from a short-lived one is not killed with it."""
    import threading

    from cluster.process import ManagedProcess

    box: list[ManagedProcess] = []

    def start() -> None:
        box.append(ManagedProcess("sleeper", ["sleep", "30"], tmp_path / "s.log").start())
        time.sleep(0.5)  # setpriv has set the signal by now

    t = threading.Thread(target=start)
    t.start()
    t.join()
    time.sleep(1.0)
    try:
        assert box[0].alive(), f"killed with its starting thread: {box[0].returncode}"
    finally:
        box[0].kill()


def test_children_started_on_cores_run_there_and_the_rest_where_the_parent_runs(tmp_path):
    """`children_on`: a child forked inside it has those cores (and its threads and children
    inherit them); the spawner thread gets its own back, so the next child does not."""
    from cluster.process import ManagedProcess, children_on

    mine = os.sched_getaffinity(0)
    if len(mine) < 2:
        pytest.skip("one core: nothing to tell apart")
    first = frozenset([min(mine)])
    with children_on(first):
        pinned = ManagedProcess("pinned", ["sleep", "30"], tmp_path / "p.log").start()
    free = ManagedProcess("free", ["sleep", "30"], tmp_path / "f.log").start()
    try:
        assert os.sched_getaffinity(pinned.pid) == first
        assert os.sched_getaffinity(free.pid) == mine
    finally:
        pinned.kill()
        free.kill()


def test_a_worker_runs_on_the_serving_cores_whoever_starts_it(tmp_path):
    """`WorkerSpec.serving_cpus`: a worker's own process goes there also when its starter runs
    elsewhere (the conductor, on the main engine's cores in the chosen shape, starting one
    for `ResizePool`); without it, where its starter runs."""
    from cluster.process import children_on
    from cluster.workers import WorkerSpec

    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip("one core: nothing to tell apart")
    stub = tmp_path / "python"  # stands in for the worker's interpreter: no engine needed
    stub.write_text("#!/bin/sh\nexec sleep 30\n")
    stub.chmod(0o755)
    spec = WorkerSpec(model=str(tmp_path), etcd="127.0.0.1:1", pool_master="127.0.0.1:1",
                      pool_metadata="http://127.0.0.1:1/metadata", run_dir=str(tmp_path),
                      python=str(stub))
    serving, elsewhere = frozenset(mine[:1]), frozenset(mine[1:])
    started = []
    try:
        with children_on(elsewhere):
            started.append(replace(spec, serving_cpus=str(mine[0])).start("prefill", "p-0")[0])
            started.append(spec.start("decode", "d-0")[0])
        assert os.sched_getaffinity(started[0].pid) == serving
        assert os.sched_getaffinity(started[1].pid) == elsewhere
    finally:
        for p in started:
            p.kill()


def test_a_childs_scratch_directory_goes_once_it_is_reaped(tmp_path):
    """`ManagedProcess(scratch=...)`: the directory (a vLLM server's sockets, which vLLM leaves
    behind) is removed by `stop` and by `kill`, not before."""
    from cluster.process import ManagedProcess

    for end in ("stop", "kill"):
        scratch = tmp_path / end
        scratch.mkdir()
        (scratch / "sock").write_text("")
        p = ManagedProcess(end, ["sleep", "30"], tmp_path / f"{end}.log",
                           scratch=str(scratch)).start()
        assert scratch.is_dir()
        getattr(p, end)()
        assert not p.alive() and not scratch.exists()
