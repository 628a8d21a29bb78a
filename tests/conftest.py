"""Shared fixtures: the tiny model, one embedded cluster per session, the reference engine."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.instance import InstanceInfo
from embedded import ClusterSpec, EmbeddedCluster

BLOCK_SIZE = 32
MAX_MODEL_LEN = 2048
DTYPE = "float32"
LEASE_TTL = 3.0
HERE = Path(__file__).resolve().parent

# Prompts of several full blocks, each used by one test only: a prompt seen before would be
# served from an engine's local prefix cache instead of the pool.
PROMPTS = {
    "e2e": "In the morning the old miller counted seven sacks of grain, and the river ran "
           "fast under the stone bridge. " * 6,
    "control": "Numbers: 4, 8, 15, 16, 23, 42. The keeper wrote them on the red door and "
               "walked back to the lighthouse. " * 6,
    "control_corrupt": "The green lantern hung above the market square while twelve "
                       "merchants argued about the price of salt and copper. " * 6,
    "late": "A decode that starts before its prefill waits for the blocks: the owl counted "
            "the stars above the frozen lake until the morning bell rang twice. " * 6,
    "never": "Blocks that never arrive are computed: nine barges drifted down the canal while "
             "the lock keeper slept beside his lamp and his dog. " * 6,
    "stall": "The pool's master stood still while the ferryman rowed across the grey bay "
             "with three baskets of apples and a sleeping cat. " * 6,
    "long": "While one engine loads a long prompt from the pool, its other streams keep "
            "going: the caravan crossed the desert at night, guided by a single star, and the "
            "merchants sang old songs about rivers they had never seen. " * 19,
}
LONG_MIN_BLOCKS = 48
"""The "long" prompt's full blocks at least (a load of that many takes many decode steps)."""
MAX_TOKENS = 16

ENGINE_FIXTURES = {"cluster", "reference", "ctl", "producer", "consumer", "decoder"}
"""Fixtures that start real vLLM engines: a test using one is marked `engine` here; a test
that starts an engine in its own body carries the marker itself."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.engine)


ETCD_FAST = {"rpc_timeout": 1.0, "max_backoff": 0.3}
"""Short etcd timeouts for `Registration` / `MembershipWatcher` in tests: failures are
noticed and retried quickly."""


def make_info(instance_id: str, role: str = "prefill") -> InstanceInfo:
    """A worker's registration as tests put it in etcd."""
    return InstanceInfo(instance_id=instance_id, role=role, address="127.0.0.1:50051",
                        model="tiny-llama", block_size=16, capacity_tokens=4096,
                        version="0.1.0", started_at=1_700_000_000.5)


def wait_until(predicate, timeout: float = 5.0, what: str = "condition not reached in time",
               interval: float = 0.02, check=None) -> float:
    """The tests' one way to wait: poll `predicate` every `interval` until it holds and return
    the seconds that took; fail the test (`what`) after `timeout`. `check`, called each round,
    may fail sooner (e.g. a cluster whose process died)."""
    t0 = time.monotonic()
    while not predicate():
        if check is not None:
            check()
        assert time.monotonic() - t0 < timeout, what
        time.sleep(interval)
    return time.monotonic() - t0


async def eventually(condition, timeout: float, interval: float = 0.05) -> bool:
    """`wait_until` for a test on the event loop: True once `condition` holds, False after
    `timeout` (the caller asserts)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(interval)
    return True


@pytest.fixture(scope="session")
def model_dir() -> str:
    """The built-in tiny model, or `KVCLUSTER_TEST_MODEL` (a local HF model directory)."""
    from tinymodel.builder import ensure_model

    return os.environ.get("KVCLUSTER_TEST_MODEL") or str(ensure_model())


@pytest.fixture
def config_only_model(tmp_path: Path) -> str:
    """A model directory holding only a config.json: all the router reads of a model."""
    cfg = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "hidden_size": 256, "head_dim": 64, "dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.fixture(scope="session")
def tokenizer(model_dir: str):
    from conductor.tokenizer import Tokenizer

    return Tokenizer(model_dir)


@pytest.fixture(scope="session")
def prompt_ids(tokenizer) -> dict[str, list[int]]:
    ids = {name: tokenizer.encode_prompt(text) for name, text in PROMPTS.items()}
    for name, toks in ids.items():
        assert len(toks) >= 4 * BLOCK_SIZE + 1, (name, len(toks))
    assert LONG_MIN_BLOCKS * BLOCK_SIZE <= len(ids["long"]) <= MAX_MODEL_LEN - MAX_TOKENS
    return ids


@pytest.fixture(scope="session")
def reference(model_dir: str, prompt_ids: dict[str, list[int]]) -> dict[str, dict]:
    """Greedy outputs of every test prompt on one standalone engine (started once)."""
    names = list(prompt_ids)
    job = {"model": model_dir, "block_size": BLOCK_SIZE, "max_model_len": MAX_MODEL_LEN,
           "dtype": DTYPE, "prompts": [prompt_ids[n] for n in names], "max_tokens": MAX_TOKENS}
    proc = subprocess.run([sys.executable, str(HERE / "reference_engine.py")],
                          input=json.dumps(job), capture_output=True, text=True, timeout=300,
                          start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    outs = json.loads(line.removeprefix("RESULT "))
    return dict(zip(names, outs, strict=True))


@pytest.fixture(scope="session")
def cluster(model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    spec = ClusterSpec(model=model_dir, prefill=1, decode=1, http_port=0,
                       run_dir=str(tmp_path_factory.mktemp("cluster")),
                       block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, dtype=DTYPE,
                       kv_cache_bytes=256 << 20, pool_segment_bytes=256 << 20,
                       lease_ttl=LEASE_TTL, conductor_args=("--disaggregate", "always"),
                       pool_shm=False,  # Mooncake's TCP transport, as across hosts
                       worker_tls=True)  # and the worker plane over mutual TLS
    c = EmbeddedCluster(spec)
    c.start(timeout=300)
    yield c
    c.stop()
