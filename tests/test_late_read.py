"""A read the pool gave up on that lands later must land only in blocks its own request still
holds (`store.connector.fences`), on a real vLLM engine: a load given up on with nothing valid
makes vLLM free the request's blocks as the load reports, and the next block another request
needs is one of them (tests/late_read_engine.py sets that up)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]

ENGINE = Path(__file__).resolve().parent / "late_read_engine.py"
LATE_S = 3.0


@pytest.fixture(scope="module")
def late(model_dir: str) -> dict:
    job = {"kv_cache_bytes": 48 * 128 * 1024, "late_s": LATE_S}
    proc = subprocess.run([sys.executable, str(ENGINE), model_dir], input=json.dumps(job),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_the_late_read_lands_only_in_blocks_its_request_holds(late: dict) -> None:
    """Reported at once (before the fix), one of the five blocks was free when the read
    landed: vLLM had given it to the other prompt for its first generated token."""
    assert late["landed_in"] == [late["x_tokens"]] * 5, late


def test_the_request_waits_for_its_read_then_recomputes(late: dict) -> None:
    again = late["x_again"]
    assert again["kv"]["pool_blocks_load_failed"] == 5, again
    assert late["together_s"] >= LATE_S * 0.9, late
    assert again["ids"] == late["x_first"]["ids"]
    assert again["lps"] == pytest.approx(late["x_first"]["lps"], abs=1e-4)
    assert late["y_again"]["cached"] > 0
    assert late["y_again"]["lps"] == pytest.approx(late["y_first"]["lps"], abs=1e-4)
