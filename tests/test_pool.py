"""The KV pool contract, against the in-memory fake and a real Mooncake master on loopback."""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest

import store.pool.mooncake as pool_module
from cluster.ports import free_port
from cluster.process import ManagedProcess
from store.master import StoreMaster
from store.pool import (
    InMemoryPool,
    KVPool,
    MooncakePool,
    Outcome,
    PoolConfig,
    PoolFull,
    PoolUnavailable,
    PutReport,
    classify,
)

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")
MiB = 1 << 20


def _config(master: StoreMaster, **kw: object) -> PoolConfig:
    kw.setdefault("segment_bytes", 64 * MiB)
    kw.setdefault("local_buffer_bytes", 16 * MiB)
    return PoolConfig(master_addr=master.master_addr, metadata_url=master.metadata_url, **kw)


def _keys(n: int) -> list[str]:
    prefix = uuid.uuid4().hex[:12]
    return [f"test/{prefix}/{i}" for i in range(n)]


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreMaster]:
    m = StoreMaster(log_path=tmp_path_factory.mktemp("master") / "master.log")
    with m:
        yield m


@pytest.fixture(scope="module", params=["memory", "mooncake"])
def pool(request: pytest.FixtureRequest) -> Iterator[KVPool]:
    p: KVPool
    if request.param == "memory":
        p = InMemoryPool()
    else:
        p = MooncakePool(_config(request.getfixturevalue("master")))
    yield p
    abandoned = len(pool_module._ABANDONED)
    p.close()
    assert len(pool_module._ABANDONED) == abandoned, "a healthy pool must really close"


# -- the contract, for both ---------------------------------------------------------------------


def test_is_a_kvpool(pool: KVPool) -> None:
    assert isinstance(pool, KVPool)
    assert pool.healthy()


def test_roundtrip_bytes_identical(pool: KVPool) -> None:
    import numpy as np

    keys = _keys(4)
    arr = np.arange(1000, dtype=np.int32)  # itemsize 4: must be stored as 4000 bytes
    values = [os.urandom(4000), bytearray(os.urandom(4000)), memoryview(os.urandom(4000)), arr]
    report = pool.put_many(list(zip(keys, values, strict=True)))
    assert report == PutReport(written=4, outcomes=(Outcome.OK,) * 4)
    assert report.ok
    got = pool.get_many(keys, expected_size=4000)
    assert got == [bytes(v) if not isinstance(v, np.ndarray) else v.tobytes() for v in values]
    assert pool.get_many(keys) == got
    assert pool.get_many(keys, expected_size=3999) == [None] * 4  # wrong size is never data


def test_missing_key_is_none_and_exists_batch(pool: KVPool) -> None:
    a, missing, b = _keys(3)
    assert pool.put_many([(a, b"A" * 100), (b, b"B" * 200)]).written == 2
    assert pool.exists([a, missing, b]) == [True, False, True]
    assert pool.get_many([a, missing, b]) == [b"A" * 100, None, b"B" * 200]
    assert pool.get_many([missing], expected_size=100) == [None]
    assert pool.exists([]) == [] and pool.get_many([]) == []


def test_first_write_wins(pool: KVPool) -> None:
    (k,) = _keys(1)
    assert pool.put_many([(k, b"first")]).written == 1
    assert pool.put_many([(k, b"second!")]).written == 1  # already there counts as written
    assert pool.get_many([k]) == [b"first"]


def test_remove(pool: KVPool) -> None:
    a, b, missing = _keys(3)
    pool.put_many([(a, b"a" * 64), (b, b"b" * 64)])
    assert pool.remove([a, missing]) == 1  # not read yet: no lease
    assert pool.exists([a, b]) == [False, True]
    assert pool.get_many([a]) == [None]
    # b is now under a read lease (exists/get grant one): only force removes it at once.
    assert pool.remove([b], force=True) == 1
    assert pool.get_many([b]) == [None]


def test_empty_values_and_keys_are_rejected(pool: KVPool) -> None:
    (k,) = _keys(1)
    with pytest.raises(ValueError):
        pool.put_many([(k, b"")])
    with pytest.raises(ValueError):
        pool.put_many([("", b"x")])


def test_batches_larger_than_the_local_buffer(pool: KVPool) -> None:
    keys = _keys(12)  # 24 MiB through a 16 MiB local buffer: chunked
    values = [bytes([i]) * (2 * MiB) for i in range(12)]
    assert pool.put_many(list(zip(keys, values, strict=True))).written == 12
    assert pool.get_many(keys, expected_size=2 * MiB) == values
    assert pool.get_many(keys) == values
    assert pool.remove(keys, force=True) == 12


def test_concurrent_callers_share_the_local_buffer(pool: KVPool) -> None:
    # 4 threads x 12 MiB at once through one 16 MiB local buffer: nothing may fail or miss.
    def work(_: int) -> tuple[PutReport, int]:
        keys = _keys(12)
        values = [os.urandom(MiB) for _ in keys]
        report = pool.put_many(list(zip(keys, values, strict=True)))
        got = pool.get_many(keys, expected_size=MiB)
        pool.remove(keys, force=True)
        return report, sum(g == v for g, v in zip(got, values, strict=True))

    with ThreadPoolExecutor(4) as ex:
        results = list(ex.map(work, range(4)))
    assert [(r.written, hits) for r, hits in results] == [(12, 12)] * 4


# -- two processes -------------------------------------------------------------------------------

_WRITER = """
import os, sys, time
from store.pool import MooncakePool, PoolConfig
keys = sys.argv[1].split(",")
with MooncakePool(PoolConfig.from_env()) as pool:
    report = pool.put_many([(k, k.encode() * 1000) for k in keys])
    print("WRITTEN", report.written, flush=True)
    # The objects may live in this process's segment: stay until the reader is done.
    deadline = time.monotonic() + 60
    while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:
        time.sleep(0.05)
"""


def test_two_processes(master: StoreMaster, tmp_path: Path) -> None:
    keys = _keys(8)
    release = tmp_path / "release"
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(ROOT),
        KVCLUSTER_POOL_MASTER_ADDR=master.master_addr,
        KVCLUSTER_POOL_METADATA_URL=master.metadata_url,
        KVCLUSTER_POOL_SEGMENT_BYTES="32MiB",
        KVCLUSTER_POOL_LOCAL_BUFFER_BYTES="16MiB",
    )
    writer = ManagedProcess(
        "writer",
        [sys.executable, "-c", _WRITER, ",".join(keys), str(release)],
        tmp_path / "writer.log",
        env=env,
        cwd=str(ROOT),
    ).start()
    reader = MooncakePool(_config(master, segment_bytes=0))  # a pure client: data is elsewhere
    try:
        deadline = time.monotonic() + 30
        while "WRITTEN" not in writer.tail() and time.monotonic() < deadline:
            assert writer.alive(), writer.tail()
            time.sleep(0.05)
        assert "WRITTEN 8" in writer.tail(), writer.tail()
        assert reader.exists(keys) == [True] * 8
        assert reader.get_many(keys) == [k.encode() * 1000 for k in keys]
    finally:
        release.touch()
        reader.close()
        writer.stop(timeout=15)


# -- pool full ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_pool_full_is_counted_not_raised(tmp_path: Path) -> None:
    # No eviction (ratio 0, watermark 1.0): a full segment stays full, deterministically.
    with StoreMaster(
        eviction_ratio=0.0, eviction_high_watermark_ratio=1.0, log_path=tmp_path / "m.log"
    ) as m:
        pool = MooncakePool(_config(m, segment_bytes=16 * MiB, local_buffer_bytes=8 * MiB))
        try:
            keys = _keys(24)
            t0 = time.monotonic()
            report = pool.put_many([(k, os.urandom(MiB)) for k in keys])
            assert time.monotonic() - t0 < 10
            assert report.total == 24 and report.failed == 0 and report.unavailable == 0
            assert 8 <= report.written < 24 and report.full == 24 - report.written
            with pytest.raises(PoolFull):
                report.raise_for_status()
            written = [k for k, o in zip(keys, report.outcomes, strict=True) if o is Outcome.OK]
            assert pool.exists(keys) == [o is Outcome.OK for o in report.outcomes]
            assert all(v is not None for v in pool.get_many(written, expected_size=MiB))
            assert pool.healthy()
        finally:
            pool.close()


def test_in_memory_knobs() -> None:
    pool = InMemoryPool(capacity_bytes=250)
    r = pool.put_many([("a", b"x" * 100), ("b", b"x" * 100), ("c", b"x" * 100)])
    assert (r.written, r.full, r.failed, r.unavailable) == (2, 1, 0, 0)
    pool.fail_puts = True
    assert pool.put_many([("d", b"x")]).full == 1
    pool.fail_puts, pool.down = False, True
    assert not pool.healthy()
    assert pool.exists(["a"]) == [False] and pool.get_many(["a"]) == [None]
    r = pool.put_many([("e", b"x")])
    assert r.unavailable == 1
    with pytest.raises(PoolUnavailable):
        r.raise_for_status()
    pool.down = False
    assert pool.get_many(["a"]) == [b"x" * 100] and pool.used_bytes == 200


def test_codes_and_config() -> None:
    assert classify(5) is Outcome.OK and classify(-704) is Outcome.MISS
    assert classify(-200) is Outcome.POOL_FULL and classify(-900) is Outcome.UNAVAILABLE
    assert classify(-12345) is Outcome.OTHER
    env = {
        "KVCLUSTER_POOL_MASTER_ADDR": "127.0.0.1:5000",
        "KVCLUSTER_POOL_METADATA_URL": "http://127.0.0.1:5001/metadata",
        "KVCLUSTER_POOL_SEGMENT_BYTES": "1GiB",
    }
    cfg = PoolConfig.from_env(env)
    assert cfg.segment_bytes == 1 << 30 and cfg.protocol == "tcp"
    for bad in (
        {"master_addr": "nohost"},
        {"metadata_url": "ftp://x"},
        {"protocol": "udp"},
        {"segment_bytes": -1},
    ):
        with pytest.raises(ValueError):
            PoolConfig.from_env(env, **bad)
    with pytest.raises(ValueError):
        PoolConfig.from_env({})


# -- master down --------------------------------------------------------------------------------


def test_setup_against_a_dead_master_fails_fast() -> None:
    port = free_port()
    cfg = PoolConfig(master_addr=f"127.0.0.1:{port}", metadata_url=f"http://127.0.0.1:{port}/m")
    t0 = time.monotonic()
    with pytest.raises(PoolUnavailable, match="not reachable"):
        MooncakePool(cfg)
    assert time.monotonic() - t0 < 2


@pytest.mark.slow
def test_master_killed_then_restarted(tmp_path: Path) -> None:
    op_timeout = 3.0
    with StoreMaster(log_path=tmp_path / "m.log") as m:
        old = MooncakePool(_config(m, op_timeout_s=op_timeout))
        try:
            keys = _keys(4)
            assert old.put_many([(k, b"v" * 1000) for k in keys]).written == 4
            m.kill()

            def timed(fn: Callable[..., T], *args: Any, **kw: Any) -> T:
                t0 = time.monotonic()
                result = fn(*args, **kw)
                elapsed = time.monotonic() - t0
                assert elapsed < op_timeout + 1.5, (fn.__name__, elapsed)
                return result

            # The first calls may wait out the RPC failure (~4.3 s, cut at op_timeout); then the
            # breaker / the client's ping makes them immediate.
            for _ in range(2):
                assert timed(old.get_many, keys) == [None] * 4
                assert timed(old.get_many, keys, expected_size=1000) == [None] * 4
                assert timed(old.exists, keys) == [False] * 4
                report = timed(old.put_many, [(k + "/new", b"n" * 100) for k in keys])
                assert report.written == 0 and report.unavailable + report.failed == 4
                assert timed(old.remove, keys) == 0
            assert not old.healthy()
            with pytest.raises(PoolUnavailable):
                MooncakePool(_config(m))

            m.restart()  # same ports, empty pool
            new = MooncakePool(_config(m))
            try:
                assert new.put_many([(keys[0], b"again")]).written == 1
                assert new.get_many([keys[0]]) == [b"again"]
                # The old client reconnects and remounts by itself.
                deadline = time.monotonic() + 15
                while not old.healthy() and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert old.healthy()
                assert old.get_many([keys[0], keys[1]]) == [b"again", None]
            finally:
                new.close()
        finally:
            old.close()
