"""`benchmarks.machine.StallWatch`: a process frozen from outside (as a paused virtual machine
freezes every process) is seen as one stall of about that length."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

CHILD = """
import json, sys
from benchmarks.machine import StallWatch
with StallWatch() as w:
    print("ready", flush=True)
    sys.stdin.readline()
print(json.dumps(w.stalls), flush=True)
"""


def test_a_frozen_process_reports_one_stall_of_the_frozen_time():
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        assert p.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        os.kill(p.pid, signal.SIGSTOP)
        time.sleep(0.6)  # the stall under test, not a wait for something to happen
        os.kill(p.pid, signal.SIGCONT)
        frozen = time.monotonic() - t0  # longer than 0.6 s when this process waited for a core
        out, _ = p.communicate("go\n", timeout=10)
    finally:
        p.kill()
    stalls = json.loads(out.strip().splitlines()[-1])
    # (a busy machine may add a short stall of its own: the frozen one must be among them)
    assert any(frozen - 0.15 <= s <= frozen + 0.3 for s in stalls), (frozen, stalls)


def test_the_cpu_probe_times_its_loop():
    from benchmarks.machine import cpu_probe_s

    small, large = cpu_probe_s(n=50_000), cpu_probe_s(n=2_000_000)
    assert 0 < small < large < 5
