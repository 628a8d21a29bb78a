"""A process stopped with SIGTERM runs its `finally` blocks, and a second signal does not cut
them short (`cluster.signals`)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys, time
from cluster.signals import stop_on_signals
if sys.argv[2] == "1":
    stop_on_signals()
try:
    print("ready", flush=True)
    time.sleep(60)
finally:
    print("cleaning", flush=True)
    sys.stdin.readline()  # the test's gate: a second signal arrives while cleaning
    open(sys.argv[1], "w").write("stopped what it started")
"""


def _start(done: Path, handled: bool) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SCRIPT, str(done), "1" if handled else "0"],
                            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> int:
    try:
        return proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("handled", [True, False])
def test_sigterm_runs_the_cleanup_only_with_the_handler(tmp_path: Path, handled: bool):
    done = tmp_path / "cleaned"
    proc = _start(done, handled)
    assert proc.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
    proc.send_signal(signal.SIGTERM)
    if handled:
        assert proc.stdout.readline().strip() == "cleaning"  # type: ignore[union-attr]
        proc.stdin.write("go\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
    rc = _finish(proc)
    assert done.exists() == handled
    assert rc != 0  # stopped, not finished


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_does_not_cut_the_cleanup_short(tmp_path: Path, second: int):
    done = tmp_path / "cleaned"
    proc = _start(done, True)
    assert proc.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.readline().strip() == "cleaning"  # type: ignore[union-attr]
    proc.send_signal(second)
    proc.stdin.write("go\n")  # type: ignore[union-attr]
    proc.stdin.flush()  # type: ignore[union-attr]
    assert _finish(proc) != 0
    assert done.exists()
