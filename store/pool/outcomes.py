"""What a pool call did: Mooncake's integer return codes turned into `Outcome`s (here and
nowhere else), the exceptions callers may want, and `PutReport`, one write's per-item result."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field


class Outcome(enum.Enum):
    OK = "ok"
    MISS = "miss"  # OBJECT_NOT_FOUND and friends: not an error, just not there
    POOL_FULL = "pool_full"  # NO_AVAILABLE_HANDLE: no space left (after eviction, if any)
    UNAVAILABLE = "unavailable"  # master unreachable / timed out / not serving
    OTHER = "other"


# ErrorCode values from mooncake-store/include/types.h (kvcache-ai/Mooncake) as of v0.3.12-0.3.13;
# -901 and -1700 per vLLM's Mooncake connector, which pins them to v0.3.12. Checked against the
# codes this binary returns: -200 (full), -600 (empty value, local buffer exhausted), -704
# (missing), -706 (remove under lease), -900 (dead master), -901 (hung master, after 30 s).
MOONCAKE_CODES: dict[int, tuple[str, Outcome]] = {
    0: ("OK", Outcome.OK),
    -1: ("INTERNAL_ERROR", Outcome.OTHER),
    -10: ("BUFFER_OVERFLOW", Outcome.OTHER),
    -100: ("SHARD_INDEX_OUT_OF_RANGE", Outcome.OTHER),
    -101: ("SEGMENT_NOT_FOUND", Outcome.POOL_FULL),
    -102: ("SEGMENT_ALREADY_EXISTS", Outcome.OTHER),
    -103: ("CLIENT_NOT_FOUND", Outcome.UNAVAILABLE),  # master restarted, client not remounted yet
    -200: ("NO_AVAILABLE_HANDLE", Outcome.POOL_FULL),
    -300: ("INVALID_VERSION", Outcome.OTHER),
    -400: ("INVALID_KEY", Outcome.OTHER),
    -500: ("WRITE_FAIL", Outcome.OTHER),
    -600: ("INVALID_PARAMS", Outcome.OTHER),
    -601: ("ILLEGAL_CLIENT", Outcome.OTHER),
    -700: ("INVALID_WRITE", Outcome.OTHER),
    -701: ("INVALID_READ", Outcome.OTHER),
    -702: ("INVALID_REPLICA", Outcome.OTHER),
    -703: ("REPLICA_IS_NOT_READY", Outcome.MISS),  # still being written
    -704: ("OBJECT_NOT_FOUND", Outcome.MISS),
    -705: ("OBJECT_ALREADY_EXISTS", Outcome.OK),  # for a put: the key is in the pool
    -706: ("OBJECT_HAS_LEASE", Outcome.OTHER),
    -707: ("LEASE_EXPIRED", Outcome.MISS),  # a read outlived its lease: data not trusted
    -708: ("OBJECT_HAS_REPLICATION_TASK", Outcome.OTHER),
    -710: ("REPLICA_NOT_FOUND", Outcome.MISS),
    -712: ("REPLICA_IS_GONE", Outcome.MISS),
    -800: ("TRANSFER_FAIL", Outcome.OTHER),
    -900: ("RPC_FAIL", Outcome.UNAVAILABLE),
    -901: ("RPC_TIMEOUT", Outcome.UNAVAILABLE),
    -1010: ("UNAVAILABLE_IN_CURRENT_STATUS", Outcome.UNAVAILABLE),
    -1011: ("UNAVAILABLE_IN_CURRENT_MODE", Outcome.UNAVAILABLE),
    -1700: ("TENANT_QUOTA_EXCEEDED", Outcome.POOL_FULL),
}


def classify(code: int) -> Outcome:
    """Outcome of a Mooncake return code: >= 0 is OK (a size or success), negatives per table."""
    if code >= 0:
        return Outcome.OK
    entry = MOONCAKE_CODES.get(code)
    return entry[1] if entry else Outcome.OTHER


def code_name(code: int) -> str:
    entry = MOONCAKE_CODES.get(code)
    return entry[0] if entry else ("OK" if code >= 0 else f"UNKNOWN({code})")


class PoolError(Exception):
    """A KV pool operation failed."""


class PoolUnavailable(PoolError):
    """The pool's master cannot be reached (down, hung, or the client could not be set up)."""


class PoolFull(PoolError):
    """The pool has no space for the value (after whatever eviction the master does)."""


@dataclass(frozen=True)
class PutReport:
    """What happened to each item of one `put_many`. A key already in the pool counts as written.
    `outcomes` is aligned with the items (OK, POOL_FULL, UNAVAILABLE or OTHER)."""

    written: int = 0
    full: int = 0
    failed: int = 0
    unavailable: int = 0
    outcomes: tuple[Outcome, ...] = field(default=(), repr=False)

    @classmethod
    def of(cls, outcomes: Iterable[Outcome]) -> PutReport:
        out = tuple(Outcome.OTHER if o is Outcome.MISS else o for o in outcomes)
        return cls(
            written=sum(o is Outcome.OK for o in out),
            full=sum(o is Outcome.POOL_FULL for o in out),
            failed=sum(o is Outcome.OTHER for o in out),
            unavailable=sum(o is Outcome.UNAVAILABLE for o in out),
            outcomes=out,
        )

    @property
    def total(self) -> int:
        return self.written + self.full + self.failed + self.unavailable

    @property
    def ok(self) -> bool:
        return self.written == self.total

    def raise_for_status(self) -> None:
        """Raise `PoolUnavailable`, `PoolFull` or `PoolError` (in that order) unless all written."""
        if self.unavailable:
            raise PoolUnavailable(f"{self.unavailable}/{self.total} puts: pool unavailable")
        if self.full:
            raise PoolFull(f"{self.full}/{self.total} puts: pool full")
        if self.failed:
            raise PoolError(f"{self.failed}/{self.total} puts failed")
