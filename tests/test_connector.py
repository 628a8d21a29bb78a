"""The KV connector's data path and failure handling, on a real Mooncake master.

Data-path tests move blocks laid out as vLLM lays them out between processes through
`KVTransfer` (what the connector runs); engine tests run a producer and a consumer vLLM engine
(module-scoped, ~20 s each to start) with the connector against their own master, and break
the pool in the ways that must end in recompute: full, a block missing, a block unreadable,
the master gone (last, it kills the master).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import psutil
import pytest
import torch

from cluster.process import vllm_scratch
from store.block_hash import block_hashes, block_key
from store.kv_transfer import BlockLayout, KVTransfer
from store.master import StoreMaster
from store.pool import InMemoryPool, MooncakePool, PoolConfig

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
BLOCK = 32
LOGPROB_TOL = 1e-4


def _cpu_layers(num_blocks: int, layers: int = 4, heads: int = 2, head_dim: int = 64,
                seed: int = 0) -> list[torch.Tensor]:
    """vLLM-CPU's per-layer KV tensors: [num_blocks, H_kv, block_size, 2*head_dim]."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(num_blocks, heads, BLOCK, 2 * head_dim, generator=gen)
            for _ in range(layers)]


def _object(layers: list[torch.Tensor], block_id: int, dim: int = 0) -> bytes:
    """The object format: every layer's block slice, flattened in logical order, concatenated."""
    return b"".join(t.select(dim, block_id).contiguous().view(torch.uint8).numpy().tobytes()
                    for t in layers)


# -- layout ------------------------------------------------------------------------------------


def test_layout_cpu_one_piece_per_layer_and_object_format() -> None:
    layers = _cpu_layers(6)
    layout = BlockLayout.of(layers, 6)
    assert layout.block_nbytes == 4 * 2 * BLOCK * 128 * 4  # 128 KiB
    assert len(layout.ranges(3)) == 4  # the block dim is first: one range per layer
    pool = InMemoryPool()
    transfer = KVTransfer(layout, lambda: pool)
    keys = [f"k{i}" for i in range(6)]
    assert transfer.save(keys, list(range(6))).written == 6
    assert pool.get_many(["k3"]) == [_object(layers, 3)]
    # Read back into other blocks of another cache: the bytes are the source's.
    dst = [torch.zeros_like(t) for t in layers]
    reader = KVTransfer(BlockLayout.of(dst, 6), lambda: pool)
    assert reader.load(keys[:3], [5, 4, 3]) == [True] * 3
    for t, d in zip(layers, dst, strict=True):
        assert torch.equal(d[5], t[0]) and torch.equal(d[3], t[2])
        assert not d[:3].any()


def test_layout_flash_attention_keeps_k_and_v_of_a_block_together() -> None:
    """GPU layout [2, num_blocks, block_size, H, D]: a block is two ranges (K, V), one object."""
    gen = torch.Generator().manual_seed(1)
    layers = [torch.randn(2, 5, BLOCK, 2, 64, generator=gen) for _ in range(3)]
    layout = BlockLayout.of(layers, 5)
    assert len(layout.ranges(0)) == 3 * 2
    pool = InMemoryPool()
    KVTransfer(layout, lambda: pool).save(["b"], [4])
    assert pool.get_many(["b"]) == [_object(layers, 4, dim=1)]


@pytest.mark.parametrize("flash", [False, True])
def test_staged_load_lands_the_same_bytes(flash: bool) -> None:
    """`staging_blocks`: one range per object, scattered into the cache afterwards."""
    gen = torch.Generator().manual_seed(2)
    shape, dim = ((2, 9, BLOCK, 2, 64), 1) if flash else ((9, 2, BLOCK, 128), 0)
    src = [torch.randn(*shape, generator=gen) for _ in range(3)]
    pool = InMemoryPool()
    keys = [f"s{i}" for i in range(9)]
    KVTransfer(BlockLayout.of(src, 9), lambda: pool).save(keys, list(range(9)))
    dst = [torch.zeros_like(t) for t in src]
    reader = KVTransfer(BlockLayout.of(dst, 9), lambda: pool, staging_blocks=4)
    order = [8, 7, 6, 5, 4, 3, 2, 1, 0]
    assert reader.load(keys + ["missing"], order + [0]) == [True] * 9 + [False]
    for s_, d in zip(src, dst, strict=True):
        assert torch.equal(d, s_.flip(dim))


# -- real master, two processes ------------------------------------------------------------------


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreMaster]:
    """Eviction off, so a full pool stays full; killed by the last engine test."""
    m = StoreMaster(eviction_ratio=0.0, eviction_high_watermark_ratio=1.0,
                    log_path=tmp_path_factory.mktemp("master") / "master.log")
    with m:
        yield m


@pytest.fixture(scope="module")
def client(master: StoreMaster) -> Iterator[MooncakePool]:
    pool = MooncakePool(PoolConfig(master_addr=master.master_addr,
                                   metadata_url=master.metadata_url, segment_bytes=0,
                                   op_timeout_s=3.0))
    yield pool
    pool.close()


_WRITER = textwrap.dedent("""
    import sys
    from store.kv_transfer import BlockLayout, KVTransfer
    from store.pool import MooncakePool, PoolConfig
    from tests.test_connector import _cpu_layers
    master, metadata, prefix = sys.argv[1:4]
    layers = _cpu_layers(16, seed=7)
    pool = MooncakePool(PoolConfig(master_addr=master, metadata_url=metadata,
                                   segment_bytes=32 << 20))
    t = KVTransfer(BlockLayout.of(layers, 16), lambda: pool)
    keys = [f"{prefix}/{i}" for i in range(16)]
    r1 = t.save(keys[:10], list(range(10)))
    r2 = t.save(keys, list(range(16)))  # the first ten are in the pool already
    print("RESULT", r1.written, r2.written, r2.deduplicated, flush=True)
    sys.stdin.read()  # keep the segment (which holds the objects) until told
    pool.close()
""")


def test_blocks_cross_processes_byte_identical_and_deduplicated(master, client) -> None:
    prefix = uuid.uuid4().hex[:8]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, master.master_addr,
                               master.metadata_url, prefix], cwd=ROOT, env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        line = ""
        assert writer.stdout is not None
        while not line.startswith("RESULT"):
            line = writer.stdout.readline()
            assert line, "writer died"
        assert line.split()[1:] == ["10", "6", "10"]  # written, written, deduplicated
        src = _cpu_layers(16, seed=7)
        dst = [torch.zeros_like(t) for t in src]
        reader = KVTransfer(BlockLayout.of(dst, 16), lambda: client)
        keys = [f"{prefix}/{i}" for i in range(16)]
        assert reader.load(keys, list(range(15, -1, -1))) == [True] * 16
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(d, s.flip(0))  # bit for bit, into other blocks
        assert client.get_many(keys[2:3]) == [_object(src, 2)]  # the object format
        # A missing key and a wrong-sized object are misses, never data.
        client.put_many([(f"{prefix}/short", b"x" * 1000)])
        assert reader.load([f"{prefix}/nope", f"{prefix}/short", keys[0]], [0, 1, 2]) == [
            False, False, True]
        assert reader.stats.load_failed == 2 and reader.stats.blocks_loaded == 17
    finally:
        writer.communicate("", timeout=60)


def test_pool_full_skips_the_save_and_counts_it(master, client) -> None:
    layers = _cpu_layers(8, seed=3)
    pool = MooncakePool(PoolConfig(master_addr=master.master_addr,
                                   metadata_url=master.metadata_url, segment_bytes=16 * MiB))
    try:
        transfer = KVTransfer(BlockLayout.of(layers, 8), lambda: pool)
        prefix = uuid.uuid4().hex[:8]
        filler = [(f"{prefix}/fill{i}", os.urandom(MiB)) for i in range(40)]
        written = [k for (k, _), o in zip(filler, pool.put_many(filler).outcomes, strict=True)
                   if o.value == "ok"]
        result = transfer.save([f"{prefix}/b{i}" for i in range(8)], list(range(8)))
        assert result.full == 8 and transfer.stats.save_skipped_full == 8
        pool.remove(written, force=True)
    finally:
        pool.close()


def test_a_save_placed_near_a_block_lands_in_its_segment(master, client) -> None:
    """Generated blocks' placement: `near` names a key; the blocks go to the segment holding
    it, not the writer's own (which prompt blocks prefer)."""
    config = PoolConfig(master_addr=master.master_addr, metadata_url=master.metadata_url,
                        segment_bytes=16 * MiB, prefer_local_segment=True)
    writer, home = MooncakePool(config), MooncakePool(config)
    try:
        prefix = uuid.uuid4().hex[:8]
        anchor, keys = f"{prefix}/anchor", [f"{prefix}/{i}" for i in range(4)]
        layers = _cpu_layers(4, seed=5)
        assert KVTransfer(BlockLayout.of(layers, 4), lambda: home).save([anchor], [0]).written
        transfer = KVTransfer(BlockLayout.of(layers, 4), lambda: writer)
        transfer.save(keys[:2], [0, 1])
        transfer.save(keys[2:], [2, 3], near=anchor, generated=True)
        assert [client.segment_of(k) for k in keys] == (
            [writer.local_hostname] * 2 + [home.local_hostname] * 2)
        assert transfer.stats.blocks_written == 4
        assert transfer.stats.blocks_saved_generated == 2
        assert client.segment_of(f"{prefix}/missing") is None
        client.remove([anchor, *keys], force=True)
    finally:
        writer.close()
        home.close()


# -- engines -----------------------------------------------------------------------------------


def _prompt(seed: int, blocks: int = 5, extra: int = 7) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 2048, (blocks * BLOCK + extra,), generator=gen).tolist()


class _Engine:
    def __init__(self, model_dir: str, role: str, master: StoreMaster, namespace: str) -> None:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        from vllm import LLM
        from vllm.config import KVTransferConfig

        ktc = KVTransferConfig(
            kv_connector="PoolConnector", kv_connector_module_path="store.connector",
            kv_role=role, kv_load_failure_policy="recompute",
            kv_connector_extra_config={"master_addr": master.master_addr,
                                       "metadata_url": master.metadata_url,
                                       "namespace": namespace, "segment_bytes": 32 * MiB,
                                       "op_timeout_s": 3.0})
        scratch: dict[str, str] = {}
        self.sockets = vllm_scratch(scratch) or ""
        """vLLM's socket files and its engine core's rendezvous file (`IPC_ENV`, `DIST_ENV`),
        which it leaves (a killed engine all of them): removed by `close`."""
        before = {c.pid for c in psutil.Process().children(recursive=True)}
        with mock.patch.dict(os.environ, scratch):
            self.llm = LLM(model=model_dir, block_size=BLOCK, dtype="float32",
                           max_model_len=1024, enforce_eager=True,
                           kv_cache_memory_bytes=64 * MiB, enable_prefix_caching=True,
                           kv_transfer_config=ktc, disable_log_stats=True)
        self.procs = [c for c in psutil.Process().children(recursive=True)
                      if c.pid not in before]
        """The engine's processes (EngineCore, Worker): killed if shutdown leaves them."""

    def close(self) -> None:
        """vLLM force-kills an EngineCore slow to exit (a Mooncake client closing against a
        dead master is), which orphans its Worker: end every process the engine started."""
        self.llm.llm_engine.engine_core.shutdown()
        for p in self.procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(self.procs, timeout=10)
        shutil.rmtree(self.sockets, ignore_errors=True)

    def run(self, prompt: list[int], max_tokens: int = 8) -> dict:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1,
                                ignore_eos=True)
        (out,) = self.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        comp = out.outputs[0]
        return {"ids": list(comp.token_ids),
                "lps": [lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs,
                                                       strict=True)],
                "cached": out.num_cached_tokens or 0, "kv": out.kv_transfer_params or {}}

    def stats(self, settle_s: float = 10.0) -> dict:
        """The connector's counters once the background saves settled (a tiny request
        carries them out: its prompt has no full block, so it moves nothing)."""
        deadline, last = time.monotonic() + settle_s, None
        while True:
            now = self.run([5, 6, 7], max_tokens=1)["kv"]["pool_stats"]
            if now == last or time.monotonic() > deadline:
                return now
            last = now
            time.sleep(0.2)


def _same(a: dict, b: dict) -> None:
    assert a["ids"] == b["ids"]
    for x, y in zip(a["lps"], b["lps"], strict=True):
        assert math.isclose(x, y, abs_tol=LOGPROB_TOL), (a["lps"], b["lps"])


@pytest.fixture(scope="module")
def namespace(model_dir: str) -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def producer(model_dir, master, namespace) -> Iterator[_Engine]:
    e = _Engine(model_dir, "kv_producer", master, namespace)
    yield e
    e.close()


@pytest.fixture(scope="module")
def consumer(model_dir, master, namespace, producer) -> Iterator[_Engine]:
    e = _Engine(model_dir, "kv_consumer", master, namespace)
    yield e
    e.close()


def _keys(namespace: str, prompt: list[int]) -> list[str]:
    return [block_key(namespace, h) for h in block_hashes(prompt, BLOCK)]


@pytest.mark.engine
def test_consumer_loads_producer_blocks_and_matches(producer, consumer, client, namespace):
    prompt = _prompt(1)
    ref = producer.run(prompt)
    assert ref["kv"]["pool_blocks_saved"] == 5
    before = producer.stats()
    assert before["blocks_written"] >= 5
    keys = _keys(namespace, prompt)
    objects = client.get_many(keys, expected_size=128 * 1024)
    assert all(o is not None for o in objects) and len(set(objects)) == 5
    got = consumer.run(prompt)
    assert got["cached"] == 5 * BLOCK
    assert got["kv"]["pool_blocks_loaded"] == 5
    assert got["kv"]["pool_blocks_load_failed"] == 0
    _same(got, ref)
    assert consumer.stats()["bytes_loaded"] >= 5 * 128 * 1024


@pytest.mark.engine
def test_shared_prefix_written_once(producer):
    shared = _prompt(2, blocks=3, extra=0)
    a, b = shared + _prompt(3, blocks=2), shared + _prompt(4, blocks=2)
    before = producer.stats()
    producer.run(a)
    mid = producer.stats()
    producer.run(b)
    after = producer.stats()
    assert mid["blocks_written"] - before["blocks_written"] == 5
    # b's shared prefix came from the engine's own cache: not computed, so not offered again
    assert after["blocks_written"] - mid["blocks_written"] == 2  # only b's own blocks
    assert after["blocks_deduplicated"] == mid["blocks_deduplicated"]


@pytest.mark.engine
def test_pool_full_computes_and_counts(producer, consumer, client):
    prefix = uuid.uuid4().hex[:8]
    junk = []
    for size in (MiB, 32 << 10):  # the engines' two 32 MiB segments, to the last crumbs
        for i in range(4096):
            key = f"junk/{prefix}/{size}/{i}"
            if client.put_many([(key, b"j" * size)]).written != 1:
                break
            junk.append(key)
    assert len(junk) > 32
    try:
        prompt = _prompt(5)
        before = producer.stats()
        ref = producer.run(prompt)
        after = producer.stats()
        assert after["save_skipped_full"] - before["save_skipped_full"] >= 1
        got = consumer.run(prompt)
        assert got["kv"]["pool_blocks_loaded"] < 5
        _same(got, ref)
    finally:
        client.remove(junk, force=True)


@pytest.mark.engine
def test_missing_block_loads_the_prefix_before_it(producer, consumer, client, namespace):
    prompt = _prompt(6)
    ref = producer.run(prompt)
    producer.stats()
    keys = _keys(namespace, prompt)
    assert client.remove([keys[2]], force=True) == 1
    before = consumer.stats()
    got = consumer.run(prompt)
    assert got["cached"] == 2 * BLOCK and got["kv"]["pool_blocks_loaded"] == 2
    assert consumer.stats()["lookup_misses"] - before["lookup_misses"] == 1
    _same(got, ref)


@pytest.mark.engine
def test_unreadable_block_falls_back_to_recompute(producer, consumer, client, namespace):
    prompt = _prompt(7)
    ref = producer.run(prompt)
    producer.stats()
    keys = _keys(namespace, prompt)
    assert client.remove([keys[1]], force=True) == 1
    assert client.put_many([(keys[1], b"\0" * 1000)]).written == 1  # present, wrong size
    before = consumer.stats()
    got = consumer.run(prompt)
    assert got["kv"]["pool_blocks_load_failed"] >= 1
    assert consumer.stats()["load_failed"] - before["load_failed"] >= 1
    _same(got, ref)


@pytest.fixture
def decoder(model_dir, master, namespace, producer) -> Iterator[_Engine]:
    """A decode-role engine (`kv_both`), killed by its test."""
    e = _Engine(model_dir, "kv_both", master, namespace)
    yield e
    e.close()


@pytest.mark.engine
def test_generated_blocks_outlive_their_decoder(producer, decoder, consumer, client, namespace):
    """Issue 8: the decoder saves the blocks its tokens fill next to the prompt's (in the
    producer's segment), is killed -9, and a fresh engine given the prompt plus the first
    `sent` tokens loads every full block of it and continues exactly as the decoder did."""
    prompt, sent, more = _prompt(9), 3 * BLOCK + 3, 8  # prompt: 5 blocks + 7 tokens
    producer.run(prompt, max_tokens=1)
    producer.stats()
    full = decoder.run(prompt, max_tokens=sent + more)
    assert full["cached"] == 5 * BLOCK
    assert full["kv"]["pool_blocks_saved_generated"] == 3
    assert decoder.stats()["blocks_saved_generated"] == 3
    continuation = prompt + full["ids"][:sent]  # 8 full blocks + 10 tokens
    keys = _keys(namespace, continuation)
    assert len(keys) == 8 and all(client.exists(keys))
    home = client.segment_of(keys[4])  # the producer's segment holds the prompt's last block
    assert home is not None and [client.segment_of(k) for k in keys[5:]] == [home] * 3
    # its engine core's rendezvous file, which a killed engine leaves, is in its own directory
    assert any(f.startswith("vllm_dist_") for f in os.listdir(decoder.sockets))
    for p in decoder.procs:  # its own segment dies with it
        p.kill()
    psutil.wait_procs(decoder.procs, timeout=10)
    got = consumer.run(continuation, max_tokens=more)
    assert got["cached"] == 8 * BLOCK  # only the last partial block is recomputed
    assert got["kv"]["pool_blocks_loaded"] == 8 and got["kv"]["pool_blocks_load_failed"] == 0
    _same(got, {"ids": full["ids"][sent:], "lps": full["lps"][sent:]})


@pytest.mark.engine
def test_master_down_degrades_to_recompute(producer, consumer, master):
    """Last: kills the module's master."""
    prompt = _prompt(8)
    master.kill()
    t0 = time.monotonic()
    ref = producer.run(prompt)
    got = consumer.run(prompt)
    assert time.monotonic() - t0 < 30
    assert got["cached"] == 0 and got["kv"]["pool_blocks_loaded"] == 0
    _same(got, ref)
    p, c = producer.stats(settle_s=15), consumer.stats()
    assert p["save_failed"] >= 1
    assert c["lookup_unavailable"] + c["lookup_misses"] >= 1
