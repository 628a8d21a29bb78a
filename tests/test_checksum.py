"""Per-block checksums (`store.checksum`, `KVTransfer(checksum=True)`): a block that comes
back from the pool different from what was saved is refused and recomputed, not used."""

from __future__ import annotations

import pytest
import torch

from store.checksum import DIGEST_BYTES, digest
from store.kv_transfer import BlockLayout, KVTransfer
from store.namespace import kv_namespace
from store.pool import InMemoryPool

BLOCKS = 6


def _cache(seed: int) -> list[torch.Tensor]:
    """vLLM-CPU's per-layer KV tensors: [num_blocks, H_kv, block_size, 2*head_dim]."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(BLOCKS, 2, 32, 128, generator=gen) for _ in range(4)]


def _corrupt(pool: InMemoryPool, key: str, at: int) -> None:
    """Flip one byte of `key`'s object in the pool (a bad segment, a buggy writer)."""
    (obj,) = pool.get_many([key])
    assert obj is not None
    bad = bytearray(obj)
    bad[at] ^= 0xFF
    pool.remove([key], force=True)
    assert pool.put_many([(key, bytes(bad))]).written == 1


@pytest.mark.parametrize("staging", [0, 4])
def test_a_corrupted_block_is_refused_and_the_others_land(staging: int) -> None:
    pool = InMemoryPool()
    src = _cache(0)
    writer = KVTransfer(BlockLayout.of(src, BLOCKS), lambda: pool, checksum=True)
    keys = [f"k{i}" for i in range(BLOCKS)]
    assert writer.save(keys, list(range(BLOCKS))).written == BLOCKS
    block_nbytes = writer.layout.block_nbytes
    (obj,) = pool.get_many(["k2"])
    assert obj is not None and len(obj) == block_nbytes + DIGEST_BYTES
    assert obj[block_nbytes:] == digest(writer.layout.ranges(2))  # the digest rides along
    _corrupt(pool, "k2", at=block_nbytes // 2)
    dst = _cache(1)
    reader = KVTransfer(BlockLayout.of(dst, BLOCKS), lambda: pool, checksum=True,
                        staging_blocks=staging)
    assert reader.load(keys, list(range(BLOCKS))) == [True, True, False, True, True, True]
    assert reader.stats.checksum_failed == 1 and reader.stats.load_failed == 1
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(s[[0, 1, 3, 4, 5]], d[[0, 1, 3, 4, 5]])
    _corrupt(pool, "k4", at=block_nbytes + 3)  # a digest damaged is refused too
    assert reader.load(["k4"], [4]) == [False]


def test_without_checksums_the_same_damage_is_used_as_kv() -> None:
    """What the checksum buys: the plain format cannot tell."""
    pool = InMemoryPool()
    src = _cache(0)
    KVTransfer(BlockLayout.of(src, BLOCKS), lambda: pool).save(["k"], [2])
    _corrupt(pool, "k", at=100)
    dst = _cache(1)
    assert KVTransfer(BlockLayout.of(dst, BLOCKS), lambda: pool).load(["k"], [2]) == [True]
    assert not all(torch.equal(s[2], d[2]) for s, d in zip(src, dst, strict=True))


def test_objects_with_and_without_digests_never_meet() -> None:
    """They differ in length (a plain reader refuses a digested object: its size) and live
    under different namespaces."""
    pool = InMemoryPool()
    KVTransfer(BlockLayout.of(_cache(0), BLOCKS), lambda: pool, checksum=True).save(["k"], [0])
    assert KVTransfer(BlockLayout.of(_cache(1), BLOCKS), lambda: pool).load(["k"], [0]) == [False]
    assert kv_namespace("org/m", 32, "float32", "vllm 1|") != \
        kv_namespace("org/m", 32, "float32", "vllm 1|", checksum=True)


def test_checksums_need_the_cache_in_host_memory() -> None:
    layout = BlockLayout.of(_cache(0), BLOCKS)
    gpu = BlockLayout(layout.bases, layout.strides, layout.pieces, layout.regions, BLOCKS,
                      "cuda")
    with pytest.raises(ValueError, match="host memory"):
        KVTransfer(gpu, lambda: None, checksum=True)
