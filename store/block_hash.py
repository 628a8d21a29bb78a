"""The block-key scheme shared by the conductor's index and the KV connector.

A prompt is cut into full blocks of `block_size` tokens; block i is identified by the chained
hash `h[i] = XXH3-128(h[i-1] || tokens of block i)`, with `h[-1]` derived from the tenant's
`cache_salt` (empty salt: a fixed seed). Two prompts share `h[i]` only if they share every
token up to the end of block i and the salt, so a hash names a whole prefix, as in Mooncake.
The trailing partial block has no hash. 128 bits: a pool key names KV that an engine loads
without checking it, so two prefixes colliding (2^-64 per pair with 64 bits, reachable at
pool scale) would hand one request another's KV. On the wire (`KvEventBatch`) a hash is 16
bytes, big-endian (`to_wire`).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

import xxhash

_ROOT = 0x6B76636C75737472_626C6F636B733132  # "kvclustrblocks12": h[-1] when there is no salt
_SEED = 0x6B76636C75737472
HASH_BYTES = 16


def root_hash(cache_salt: str | None = None) -> int:
    """h[-1]: the chain's seed, separating tenants that set different salts."""
    if not cache_salt:
        return _ROOT
    return xxhash.xxh3_128_intdigest(cache_salt.encode(), seed=_SEED)


def block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> list[int]:
    """Chained 128-bit hashes of every full block of `token_ids`."""
    return extend_hashes(None, token_ids, block_size, cache_salt)


def extend_hashes(
    parent: int | None, token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> list[int]:
    """Hashes of the full blocks of `token_ids` continuing the chain whose last block hash is
    `parent` (None: a new chain from `root_hash(cache_salt)`, i.e. `block_hashes`)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    tokens = array("I", token_ids)
    raw = tokens.tobytes()
    step = block_size * tokens.itemsize
    prev = root_hash(cache_salt) if parent is None else parent
    out: list[int] = []
    for start in range(0, (len(tokens) // block_size) * step, step):
        prev = xxhash.xxh3_128_intdigest(prev.to_bytes(HASH_BYTES, "little")
                                         + raw[start : start + step])
        out.append(prev)
    return out


def block_key(namespace: str, block_hash: int) -> str:
    """The pool's object key for one block of a model/layout `namespace`."""
    return f"{namespace}/{block_hash:032x}"


def to_wire(hashes: Iterable[int]) -> list[bytes]:
    return [h.to_bytes(HASH_BYTES, "big") for h in hashes]


def from_wire(raw: Iterable[bytes]) -> list[int]:
    return [int.from_bytes(b, "big") for b in raw]
