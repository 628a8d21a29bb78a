"""Per-block checksums of the pool's objects (`KVTransfer(checksum=True)`).

With them a block's object is its KV bytes followed by `DIGEST_BYTES` of XXH3-128 over those
bytes, written by the saver; a load that arrives whole but does not match its digest counts
as failed, and vLLM recomputes the block, instead of attending to bytes that are not the
prompt's (a corrupted segment, a writer with a bug). The digests move with the blocks in the
same zero-copy calls, from slots in host memory the pool can register (`Digests`), so an
object and its digest cannot be torn apart. Objects with digests are longer than those
without: the two live under different namespaces (`store.namespace.kv_namespace`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import xxhash

from store.pool import PoolError, ZeroCopyPool

DIGEST_BYTES = 16


def digest(ranges: Sequence[tuple[int, int]]) -> bytes:
    """XXH3-128 over the memory `ranges` (address, nbytes), in order, without copying."""
    h = xxhash.xxh3_128()
    for addr, n in ranges:
        h.update((ctypes.c_char * n).from_address(addr))
    return h.digest()


class Digests:
    """`n` digest slots in memory `pool` can register: its shared memory for a Mooncake dummy
    client (the only memory such a client registers), else ordinary host memory."""

    def __init__(self, n: int, pool: ZeroCopyPool) -> None:
        nbytes = n * DIGEST_BYTES
        try:
            addr = pool.alloc_shared(nbytes)  # type: ignore[attr-defined]
            raw = np.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr), np.uint8)
        except (AttributeError, PoolError):  # not a dummy client: its own memory will do
            raw = np.zeros(nbytes, np.uint8)
        self.array = raw.reshape(n, DIGEST_BYTES)

    @property
    def region(self) -> tuple[int, int]:
        """(address, nbytes) to register with the pool."""
        return self.array.ctypes.data, self.array.nbytes

    def slot(self, i: int) -> tuple[int, int]:
        """The range of slot `i`, the last piece of its block's object."""
        return self.array.ctypes.data + i * DIGEST_BYTES, DIGEST_BYTES

    def seal(self, i: int, ranges: Sequence[tuple[int, int]]) -> None:
        """Slot `i` := the digest of `ranges` (before the object is written)."""
        self.array[i] = np.frombuffer(digest(ranges), np.uint8)

    def verify(self, i: int, ranges: Sequence[tuple[int, int]]) -> bool:
        """Whether `ranges` match the digest that arrived in slot `i`."""
        return digest(ranges) == self.array[i].tobytes()
