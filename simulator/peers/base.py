"""What the re-implemented peer routers share: the engine metrics they scrape, the router-side
counters they keep, an approximate prefix tree of routed blocks, and a replayable tie-break.

A peer is a callable object `(ClusterSnapshot, RouteRequest) -> Route | None` with the
conductor policies' signature. Unlike them it keeps state, as its source does (an approximate
radix tree of what it routed where, its own in-flight counters), in the object itself; the
simulator owns one object per run and tells it what a real router is told:

- `bind(scrape)`: a callable returning every engine's metrics now (what a router polls from
  `/metrics`); the simulator's engines answer it without staleness, the kindest case.
- `prefilled(seq)`, `finished(seq)`: a request's prefill ended (its first token on a P/D
  pair) and its response ended; a router sees both on its own connections.

Peers never reject: they have no SLO admission (`None` only when a pool is empty).
Instance order is the snapshot's (prefill, then decode, by id), which stands for the
order of the peer's worker list.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from conductor.scheduler import ClusterSnapshot, InstanceLoad, Route, RouteRequest
from conductor.scheduler import loadable_blocks as _loadable

_MIX = 0x9E3779B97F4A7C15


@dataclass(frozen=True)
class EngineMetrics:
    """One engine's metrics as a router scrapes them (vLLM's `/metrics` names)."""

    waiting: int
    """Requests queued in the engine and not running (`vllm:num_requests_waiting`): prompts
    not started; on a decode engine also requests whose KV is still arriving."""
    running: int
    """Requests running (`vllm:num_requests_running`)."""
    kv_usage: float
    """Share of the KV cache held by running requests (`vllm:kv_cache_usage_perc`)."""
    cache_blocks: int
    """The engine's KV cache size in blocks (`cache_config_info` num_gpu_blocks)."""


Scrape = Callable[[], Mapping[str, EngineMetrics]]


def draw(seq: int, salt: int = 0) -> int:
    """A replayable stand-in for a uniform random draw, from the request counter."""
    x = ((seq + salt) * _MIX) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 29)) >> 16


def pick_tied(candidates: Sequence[InstanceLoad], seq: int, salt: int = 0) -> InstanceLoad:
    """One of equally good candidates, drawn as the peers draw ties (uniformly)."""
    return candidates[draw(seq, salt) % len(candidates)]


class PeerRouter:
    """Base of the re-implemented routers: no-op hooks, and the scrape the simulator binds."""

    name = "peer"

    def __init__(self) -> None:
        self._scrape: Scrape = dict

    def bind(self, scrape: Scrape) -> None:
        self._scrape = scrape

    def metrics(self) -> Mapping[str, EngineMetrics]:
        return self._scrape()

    def prefilled(self, seq: int) -> None:
        """The request's prefill ended (its first token, for a disaggregated pair)."""

    def finished(self, seq: int) -> None:
        """The request's response ended."""

    def __call__(self, snap: ClusterSnapshot, req: RouteRequest) -> Route | None:
        raise NotImplementedError


def route(snap: ClusterSnapshot, req: RouteRequest, prefill: InstanceLoad,
          decode: InstanceLoad) -> Route:
    """A Route with the predictions the simulator's loads expect (the prefill work it adds to
    its instance's queue), from the index's view of the prefill engine's cache."""
    bs = prefill.block_size
    cached = min(req.match.local.get(prefill.instance_id, 0),
                 _loadable(req.num_prompt_tokens, bs))
    uncached = req.num_prompt_tokens - cached * bs
    seconds = snap.params.prefill.predict(uncached, cached * bs)
    return Route(prefill_id=prefill.instance_id, decode_id=decode.instance_id,
                 cached_blocks=cached, uncached_tokens=uncached, prefill_s=seconds,
                 predicted_ttft_s=seconds)


class Counter:
    """A router's own per-worker request counts: incremented when it routes, decremented when
    it sees the phase end (`Worker.load()` in vllm-router and SMG)."""

    def __init__(self) -> None:
        self.load: dict[str, int] = {}
        self.processed: dict[str, int] = {}
        self._held: dict[int, list[str]] = {}

    def add(self, seq: int, worker: str) -> None:
        self.load[worker] = self.load.get(worker, 0) + 1
        self.processed[worker] = self.processed.get(worker, 0) + 1
        self._held.setdefault(seq, []).append(worker)

    def release(self, seq: int) -> None:
        for worker in self._held.pop(seq, ()):
            self.load[worker] -= 1

    def of(self, worker: str) -> int:
        return self.load.get(worker, 0)


class ApproxTree:
    """An approximate prefix tree of routed requests: which worker (tenant) was sent which
    chain of blocks, with LRU eviction.

    `shared=True`: one bound on the tree's distinct blocks, whoever holds them, evicting the
    least recently used (tenant, block) entries until it holds (SMG's `max_tree_size`); else
    each tenant is bounded alone (vllm-router's `evict_tenant_by_size`). Blocks stand for the
    trees' characters or tokens: a chain's prefix match is the tree's matched prefix. Eviction
    happens on insert rather than on the peers' periodic timer.
    """

    def __init__(self, capacity_blocks: int | None, shared: bool) -> None:
        self.capacity = capacity_blocks
        self.shared = shared
        self._tenants: dict[str, OrderedDict[int, int]] = {}
        """tenant -> block -> stamp of its last insertion, least recently used first"""
        self._all: OrderedDict[tuple[str, int], None] = OrderedDict()
        """shared mode: every (tenant, block), least recently used first"""
        self._holders: dict[int, int] = {}
        """shared mode: block -> how many tenants hold it"""
        self._stamp = 0

    def match(self, hashes: Sequence[int], tenants: Iterable[str]) -> dict[str, int]:
        """Blocks of `hashes` each tenant holds as a prefix."""
        out = {}
        for t in tenants:
            held = self._tenants.get(t)
            k = 0
            if held:
                for h in hashes:
                    if h not in held:
                        break
                    k += 1
            out[t] = k
        return out

    def deepest(self, hashes: Sequence[int], tenants: Iterable[str]
                ) -> tuple[int, list[str], dict[str, int]]:
        """(longest match over tenants, the tenants holding it, every tenant's match)."""
        m = self.match(hashes, tenants)
        best = max(m.values(), default=0)
        return best, [t for t, k in m.items() if k == best and best > 0], m

    def last_tenant(self, holders: Sequence[str], hashes: Sequence[int], depth: int) -> str:
        """Of the holders of a matched node, the one routed through it last (the trees keep
        a node's last tenant and answer it)."""
        h = hashes[depth - 1]
        return max(holders, key=lambda t: self._tenants[t].get(h, -1))

    def insert(self, hashes: Sequence[int], tenant: str) -> None:
        held = self._tenants.setdefault(tenant, OrderedDict())
        self._stamp += 1
        stamp = self._stamp
        every = self._all if self.shared else None
        for h in reversed(hashes):  # tail first: the head ends most recent, evicted last
            if h in held:
                held.move_to_end(h)
            held[h] = stamp
            if every is not None:
                key = (tenant, h)
                if key in every:
                    every.move_to_end(key)
                else:
                    every[key] = None
                    self._holders[h] = self._holders.get(h, 0) + 1
        self._evict(held)

    def __len__(self) -> int:
        """Distinct blocks held (shared mode) or entries over all tenants."""
        if self.shared:
            return len(self._holders)
        return sum(len(held) for held in self._tenants.values())

    def _evict(self, held: OrderedDict[int, int]) -> None:
        cap = self.capacity
        if cap is None:
            return
        if self.shared:
            every, holders = self._all, self._holders
            while len(holders) > cap:
                (t, h), _ = every.popitem(last=False)
                del self._tenants[t][h]
                holders[h] -= 1
                if not holders[h]:
                    del holders[h]
            return
        while len(held) > cap:
            held.popitem(last=False)
