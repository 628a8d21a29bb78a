"""Tenants and the operator's limits on them: how many requests each may have in flight, how
many tokens per second it may send, the highest priority class its requests run in, and
whether it may ask for looser SLOs than the operator's.

A tenant is named by its API key (`conductor.auth`; requests without keys belong to the
tenant ""). A tenant without limits of its own takes the default ones (tenant `*`). Limits
come from `--tenant-limits-file` at start and `SetTenantLimits` at run time (`conductorctl
tenant`).
"""

from __future__ import annotations

import math
import time
import tomllib
from dataclasses import dataclass, fields, replace
from typing import Any

PRIORITIES = ("interactive", "batch")
"""Priority classes, highest first: `batch` waits in a queue and is shed before
`interactive`, which never waits behind it (`conductor.flow`)."""
DEFAULT = "*"
"""The tenant name whose limits apply to tenants without their own."""
BURST_S = 10.0
"""A tenant's token bucket holds this many seconds of its rate."""
MAX_NAME = 128


@dataclass(frozen=True)
class Limits:
    max_concurrency: int = 0
    """Requests of the tenant in flight at once (queued ones included); 0: no limit."""
    tokens_per_s: float = 0.0
    """Tokens per second the tenant may send (each request counts its prompt and the output it
    may produce, `max_tokens` per choice; unused output is given back when it ends); bursts up
    to `BURST_S` seconds' worth. 0: no limit."""
    priority: str = "interactive"
    """The highest class its requests run in (and the class they get by default); a request
    may ask for a lower one with the `x-kvcluster-priority` header."""
    may_loosen_slo: bool = False
    """Its requests' `ttft_slo_ms` / `tbt_slo_ms` may be looser than the operator's SLOs
    (otherwise they only tighten them)."""

    def __post_init__(self) -> None:
        if isinstance(self.max_concurrency, bool) or not isinstance(self.max_concurrency, int) \
                or not 0 <= self.max_concurrency <= 1_000_000:
            raise ValueError(f"max_concurrency must be an integer in [0, 1000000], got "
                             f"{self.max_concurrency!r}")
        if isinstance(self.tokens_per_s, bool) or not isinstance(
                self.tokens_per_s, int | float) or not (
                math.isfinite(self.tokens_per_s) and 0 <= self.tokens_per_s <= 1e12):
            raise ValueError(f"tokens_per_s must be a number in [0, 1e12], got "
                             f"{self.tokens_per_s!r}")
        if self.priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {PRIORITIES}, got {self.priority!r}")
        if not isinstance(self.may_loosen_slo, bool):
            raise ValueError(f"may_loosen_slo must be true or false, got "
                             f"{self.may_loosen_slo!r}")

    def with_changes(self, **changes: Any) -> Limits:
        """These limits with some fields changed (None: unchanged)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


def check_name(tenant: str) -> str:
    if not isinstance(tenant, str) or len(tenant) > MAX_NAME or any(
            not c.isprintable() for c in tenant):
        raise ValueError(f"a tenant name is printable text of at most {MAX_NAME} characters")
    return tenant


def load_limits(path: str) -> dict[str, Limits]:
    """`[tenants.<name>]` tables of `Limits` fields from a TOML file (`[tenants."*"]`: the
    default); ValueError naming the table for anything else."""
    if not path:
        return {}
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"tenant_limits_file unreadable: {e}") from e
    unknown = set(doc) - {"tenants"}
    if unknown:
        raise ValueError(f"tenant_limits_file: unknown tables {sorted(unknown)}")
    names = {f.name for f in fields(Limits)}
    out = {}
    for tenant, table in doc.get("tenants", {}).items():
        if not isinstance(table, dict) or set(table) - names:
            raise ValueError(f"tenant_limits_file [tenants.{tenant}]: fields must be among "
                             f"{sorted(names)}")
        try:
            out[check_name(tenant)] = Limits(**table)
        except ValueError as e:
            raise ValueError(f"tenant_limits_file [tenants.{tenant}]: {e}") from None
    return out


class TokenBucket:
    """`rate` tokens per second, holding at most `BURST_S` seconds' worth; it starts full."""

    def __init__(self, rate: float, now: float | None = None) -> None:
        self.rate = rate
        self.capacity = rate * BURST_S
        self.level = self.capacity
        self._at = time.monotonic() if now is None else now

    def _fill(self, now: float) -> None:
        if now > self._at:
            self.level = min(self.capacity, self.level + (now - self._at) * self.rate)
            self._at = now

    def take(self, tokens: float, now: float) -> float:
        """Take `tokens` (0.0 then), or the seconds until they could be taken. A request larger
        than the bucket goes through when it is full (it runs the bucket into debt)."""
        self._fill(now)
        if self.level >= min(tokens, self.capacity):
            self.level -= tokens
            return 0.0
        return (min(tokens, self.capacity) - self.level) / self.rate

    def give(self, tokens: float) -> None:
        self.level = min(self.capacity, self.level + tokens)


@dataclass
class TenantState:
    """One tenant's use of its limits now."""

    limits: Limits
    bucket: TokenBucket | None = None
    in_flight: int = 0
    admitted: int = 0
    rejected: int = 0

    def rebucket(self) -> None:
        """A bucket for its rate (kept when the rate did not change)."""
        rate = self.limits.tokens_per_s
        if not rate:
            self.bucket = None
        elif self.bucket is None or self.bucket.rate != rate:
            self.bucket = TokenBucket(rate)


class Tenants:
    """The limits of every tenant the operator named, and each tenant's use of them."""

    def __init__(self, limits: dict[str, Limits] | None = None) -> None:
        self._limits = dict(limits or {})
        self._limits.setdefault(DEFAULT, Limits())
        self._states: dict[str, TenantState] = {}

    def limits(self, tenant: str) -> Limits:
        return self._limits.get(tenant) or self._limits[DEFAULT]

    def configured(self) -> dict[str, Limits]:
        return dict(self._limits)

    def set(self, tenant: str, limits: Limits) -> None:
        """Set a tenant's limits (`*`: the default) from now on; requests in flight keep
        running."""
        self._limits[check_name(tenant)] = limits
        for name, state in self._states.items():
            state.limits = self.limits(name)
            state.rebucket()

    def reset(self, tenant: str) -> None:
        """Back to the default limits (the default itself back to none)."""
        if tenant == DEFAULT:
            self._limits[DEFAULT] = Limits()
        else:
            self._limits.pop(tenant, None)
        self.set(DEFAULT, self._limits[DEFAULT])

    def state(self, tenant: str) -> TenantState:
        s = self._states.get(tenant)
        if s is None:
            s = self._states[tenant] = TenantState(self.limits(tenant))
            s.rebucket()
        return s

    def states(self) -> dict[str, TenantState]:
        return dict(self._states)
