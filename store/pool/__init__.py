"""The KV pool behind one small protocol: a Mooncake Store client, or an in-memory fake.

Keys are `str`, values bytes-like. Callers see booleans, `None` for a miss, `PutReport` counts,
and `PoolError`/`PoolUnavailable`/`PoolFull` where they want exceptions.

- `protocol`: `KVPool`, `ZeroCopyPool` and the argument checks both implementations share;
- `outcomes`: Mooncake's return codes as `Outcome`s (the one place they are read), errors;
- `config`: `PoolConfig`, validated once, and the master probe;
- `mooncake`: `MooncakePool`, the real client (and what was measured about Mooncake);
- `calls`: the threads, staging gate and deadline its blocking calls run under;
- `memory`: `InMemoryPool`, the fake.
"""

from store.pool.config import PROTOCOLS, PoolConfig, parse_size
from store.pool.memory import InMemoryPool
from store.pool.mooncake import MooncakePool
from store.pool.outcomes import (
    MOONCAKE_CODES,
    Outcome,
    PoolError,
    PoolFull,
    PoolUnavailable,
    PutReport,
    classify,
    code_name,
)
from store.pool.protocol import Fences, KVPool, Ranges, Value, ZeroCopyPool

__all__ = [
    "MOONCAKE_CODES", "PROTOCOLS", "Fences", "InMemoryPool", "KVPool", "MooncakePool", "Outcome",
    "PoolConfig", "PoolError", "PoolFull", "PoolUnavailable", "PutReport", "Ranges", "Value",
    "ZeroCopyPool", "classify", "code_name", "parse_size",
]
