"""A save that has not read its blocks yet when vLLM preempts its request (and gives the blocks
to another request in that step) publishes the request's own KV, on a real vLLM engine: the
step waits for it, however long (tests/preempt_engine.py sets that up)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.timeout(320)]

ENGINE = Path(__file__).resolve().parent / "preempt_engine.py"
LATE_S = 4.0


@pytest.fixture(scope="module")
def preempt(model_dir: str) -> dict:
    job = {"kv_cache_bytes": 9 * 128 * 1024, "late_s": LATE_S}
    proc = subprocess.run([sys.executable, str(ENGINE), model_dir], input=json.dumps(job),
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_every_object_published_is_its_blocks_bytes_as_they_were_when_saved(preempt: dict):
    """Before the fix the step went on after 30 s (0.5 s here), and the other request's KV
    was published under the preempted request's keys."""
    assert preempt["preempted"], preempt
    assert preempt["writes"] >= 6 and preempt["mismatched"] == 0, preempt
    assert preempt["waited_s"][0] >= LATE_S * 0.9, preempt


def test_the_preempted_stream_continued_from_the_pool_goes_on_alike(preempt: dict):
    """The block Y's tokens filled is the one vLLM gave first to the other request: published
    from it after the other's forward pass, the continuation would load that request's KV."""
    again, first, sent = preempt["y_again"], preempt["y_first"], preempt["sent"]
    assert again["kv"]["pool_blocks_loaded"] == 4, again["kv"]
    assert again["ids"] == first["ids"][sent:sent + 8]
    assert again["lps"] == pytest.approx(first["lps"][sent:sent + 8], abs=1e-4)
    stats = again["kv"]["pool_stats"]
    assert stats["held_preempted"] >= 1 and stats["held_preempted_seconds"] >= LATE_S * 0.9
