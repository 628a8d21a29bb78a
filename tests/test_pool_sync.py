"""The index follows the pool's key listing (the Mooncake master's /get_all_keys): evictions
drop out, a restarted conductor rebuilds its pool view. Against a real master."""

from __future__ import annotations

import httpx
import pytest

from conductor.scheduler.index import POOL, KVIndex
from conductor.scheduler.pool_sync import PoolSync, parse_keys
from store.block_hash import block_hashes, block_key
from store.master import StoreMaster
from store.pool import MooncakePool, PoolConfig


def test_parse_keeps_only_the_given_namespaces():
    text = (f"{block_key('kv-a', 255)}\n{block_key('kv-b', 1)}\nkv-a/zz\nkv-a/0001\n"
            "kv-a/00000000000000ff\njunk\n")  # the last key: 64 bits, an older scheme's
    assert parse_keys(text, {"kv-a"}) == {255}
    assert parse_keys(text, {"kv-a", "kv-b"}) == {255, 1}


def test_sync_makes_the_location_hold_exactly_the_listing_but_keeps_predictions():
    idx = KVIndex(1000)
    idx.store(POOL, [1, 2, 3])
    idx.predict(POOL, [9], now=0.0)
    assert idx.sync(POOL, {2, 3, 4}) == (1, 1)
    assert idx.match([2, 3, 4]).pool == 3 and idx.match([1]).pool == 0
    assert idx.match([9]).pool == 1  # a routed request's blocks, not written yet


@pytest.mark.slow
async def test_evictions_and_a_restart_reach_the_index(tmp_path):
    chain = block_hashes(list(range(32 * 6)), 32)
    with StoreMaster(log_path=tmp_path / "master.log").start() as master:
        cfg = PoolConfig(master_addr=master.master_addr, metadata_url=master.metadata_url,
                         segment_bytes=32 << 20, local_buffer_bytes=8 << 20)
        with MooncakePool(cfg) as pool:
            pool.put_many([(block_key("kv-test", h), b"x" * 1024) for h in chain])
            pool.put_many([(block_key("kv-other", 7), b"y" * 1024)])
            url = master.metrics_url.rsplit("/", 1)[0]
            index = KVIndex(1000)  # a conductor that just (re)started: the pool is unknown
            sync = PoolSync(index, url, lambda: {"kv-test"}, interval_s=1.0)
            async with httpx.AsyncClient(timeout=5) as client:
                assert await sync.sync_once(client) == (6, 0)
                assert index.match(chain).pool == 6 and index.blocks(POOL) == 6
                # the tail of the chain leaves the pool (evicted): the index follows
                assert pool.remove([block_key("kv-test", h) for h in chain[4:]], force=True) == 2
                assert await sync.sync_once(client) == (0, 2)
                assert index.match(chain).pool == 4
    with pytest.raises(httpx.HTTPError):  # the master is gone: an error, the view is kept
        async with httpx.AsyncClient(timeout=2) as client:
            await sync.sync_once(client)
    assert index.match(chain).pool == 4
