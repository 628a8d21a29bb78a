"""A benchmark stopped with SIGTERM runs its `finally` blocks (`benchmarks.signals`)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import sys, time
from benchmarks.signals import stop_on_sigterm
if sys.argv[2] == "1":
    stop_on_sigterm()
try:
    print("ready", flush=True)
    time.sleep(60)
finally:
    open(sys.argv[1], "w").write("stopped what it started")
"""


@pytest.mark.parametrize("handled", [True, False])
def test_sigterm_runs_the_cleanup_only_with_the_handler(tmp_path: Path, handled: bool):
    done = tmp_path / "cleaned"
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(done), "1" if handled else "0"],
                            cwd=root, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert done.exists() == handled
    assert rc != 0  # stopped, not finished
