"""The global KV index: which prompt blocks the pool and each instance's engine cache hold.

Blocks are named by the chained hash of `store.block_hash` (the pool's keys use the same),
so a hash names a whole prefix including the tenant's `cache_salt`. Each indexed block maps
to one int whose bit 0 is the pool and bit `s` the location in slot `s`, so one lookup per
block answers for every location at once.

Two kinds of bits, kept apart so that a guess never outlives its evidence:
- confirmed (`store`/`remove`/`clear`): from engine KV events and worker replies;
- predicted (`predict`): what the conductor just routed, withdrawn after `ttl_s` unless
  confirmed by then.

Memory is bounded: two generations of at most `max_blocks / 2` entries each. Storing a
block puts it in the young generation; when that is full, the old one is dropped whole and
the young one becomes old, so the least recently stored blocks go first, at O(1) amortised
cost and without holes in the tables (forgetting a block only makes the scheduler
under-estimate a hit). Per block: a dict entry, a 128-bit int key, and a mask object shared
with every block held by the same locations; `make bench-sched` reports the bytes.
"""

from __future__ import annotations

import sys
from collections import Counter, deque
from collections.abc import Iterable, Sequence

import structlog

from conductor.scheduler.snapshot import PrefixMatch

log = structlog.get_logger(__name__)

POOL = "/pool"
"""The pool's location name (instance ids never contain '/')."""

_INTERN_MAX = 1 << 18
_HASH_INT_BYTES = sys.getsizeof(1 << 127)
_EMPTY = PrefixMatch()


class KVIndex:
    def __init__(self, max_blocks: int = 1_000_000, ttl_s: float = 10.0) -> None:
        if max_blocks <= 1:
            raise ValueError("max_blocks must be at least 2")
        self.max_blocks = max_blocks
        self.ttl_s = ttl_s
        self._young: dict[int, int] = {}
        self._old: dict[int, int] = {}
        self._predicted: dict[int, int] = {}
        self._expiry: deque[tuple[float, int, Sequence[int]]] = deque()
        self._slot: dict[str, int] = {POOL: 0}
        self._names: list[str | None] = [POOL]
        self._counts: list[int] = [0]
        self._free: list[int] = []
        self._intern: dict[int, int] = {}
        self._named: dict[int, tuple[str, ...]] = {}
        """mask -> the names of its locations, for `match` (cleared when slots change)"""
        self.evicted = 0
        self._changed: set[int] = set()
        """slots whose block count changed since `take_changed`"""

    # ------------------------------------------------------------------ locations

    def add_location(self, name: str) -> int:
        """Give a location (an instance id) its slot; idempotent."""
        if name in self._slot:
            return self._slot[name]
        slot = self._free.pop() if self._free else len(self._names)
        if slot == len(self._names):
            self._names.append(name)
            self._counts.append(0)
        else:
            self._names[slot] = name
        self._slot[name] = slot
        self._named.clear()
        return slot

    def remove_location(self, name: str) -> None:
        """Forget a location (an instance left) and free its slot."""
        slot = self._slot.get(name)
        if slot is None or name == POOL:
            return
        self.clear(name)
        del self._slot[name]
        self._names[slot] = None
        self._free.append(slot)
        self._named.clear()

    def locations(self) -> list[str]:
        return [n for n in self._names if n is not None]

    def blocks(self, name: str) -> int:
        """How many blocks the index holds for a location (confirmed and predicted)."""
        slot = self._slot.get(name)
        return 0 if slot is None else self._counts[slot]

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def memory_bytes(self) -> int:
        """What the index holds in memory: its hash tables and the 128-bit hash ints (the
        masks are shared between blocks of the same locations)."""
        tables = sum(sys.getsizeof(d) for d in (self._young, self._old, self._predicted))
        return tables + len(self) * _HASH_INT_BYTES

    def take_changed(self) -> list[str]:
        """The locations whose block count changed since the last call."""
        names = self._names
        out = [n for s in self._changed if (n := names[s]) is not None and n != POOL]
        self._changed.clear()
        return out

    # ------------------------------------------------------------------ updates

    def store(self, name: str, hashes: Iterable[int]) -> None:
        """Confirmed: the location holds these blocks (now the most recently stored)."""
        slot = self._slot.get(name)
        if slot is not None:
            self._set(1 << slot, slot, hashes, predicted=False)

    def predict(self, name: str, hashes: Sequence[int], now: float) -> None:
        """Predicted: the location will hold these blocks once the routed request ran. The bits
        are withdrawn at `now + ttl_s` unless `store` confirms them first."""
        slot = self._slot.get(name)
        if slot is None or not hashes:
            return
        self._set(1 << slot, slot, hashes, predicted=True)
        self._expiry.append((now + self.ttl_s, 1 << slot, hashes))

    def sync(self, name: str, hashes: set[int]) -> tuple[int, int]:
        """The location holds exactly `hashes` (a full listing of it): confirmed bits it
        lacks are dropped (evicted), the others set (a restarted conductor learns them);
        predictions stay until confirmed or expired. O(indexed blocks); returns (added,
        dropped)."""
        slot = self._slot.get(name)
        if slot is None:
            return 0, 0
        bit, pred = 1 << slot, self._predicted
        held = {h for gen in (self._young, self._old) for h, m in gen.items() if m & bit}
        gone = [h for h in held if h not in hashes and not pred.get(h, 0) & bit]
        self._drop_bit(bit, slot, gone)
        new = [h for h in hashes if h not in held]
        self._set(bit, slot, new, predicted=False)
        return len(new), len(gone)

    def withdraw(self, name: str, hashes: Iterable[int]) -> None:
        """Take back predictions (not confirmed bits): the routed request failed there."""
        slot = self._slot.get(name)
        if slot is None:
            return
        bit, pred = 1 << slot, self._predicted
        stale = [h for h in hashes if pred.get(h, 0) & bit]
        if stale:
            self._drop_bit(bit, slot, stale)

    def remove(self, name: str, hashes: Iterable[int]) -> None:
        """The location no longer holds these blocks (evicted)."""
        slot = self._slot.get(name)
        if slot is not None:
            self._drop_bit(1 << slot, slot, hashes)

    def truncate(self, name: str, hashes: Sequence[int], keep: int) -> None:
        """Correction from a worker's reply: of this chain the location holds only the first
        `keep` blocks, whatever the index believed."""
        self.remove(name, hashes[max(keep, 0):])

    def clear(self, name: str) -> None:
        """The location holds nothing (engine cache reset, instance gone). O(indexed blocks)."""
        slot = self._slot.get(name)
        if slot is None:
            return
        bit = 1 << slot
        held = [h for gen in (self._young, self._old) for h, m in gen.items() if m & bit]
        self._drop_bit(bit, slot, held)
        self._counts[slot] = 0
        self._changed.add(slot)

    def expire(self, now: float) -> None:
        """Withdraw the predicted bits whose time is up."""
        expiry, pred = self._expiry, self._predicted
        while expiry and expiry[0][0] <= now:
            _, bit, hashes = expiry.popleft()
            stale = [h for h in hashes if pred.get(h, 0) & bit]
            if stale:
                self._drop_bit(bit, bit.bit_length() - 1, stale)

    def _set(self, bit: int, slot: int, hashes: Iterable[int], predicted: bool) -> None:
        young, old, pred, intern = self._young, self._old, self._predicted, self._intern
        added = 0
        for h in hashes:
            m = young.get(h)
            if m is None:
                m = old.pop(h, 0)
            if not m & bit:
                added += 1
                if predicted:
                    pred[h] = pred.get(h, 0) | bit
            elif not predicted and h in pred and pred[h] & bit:  # confirmed now
                p = pred[h] & ~bit
                if p:
                    pred[h] = p
                else:
                    del pred[h]
            m |= bit
            young[h] = intern.setdefault(m, m)
        if added:
            self._counts[slot] += added
            self._changed.add(slot)
        if len(intern) > _INTERN_MAX:
            intern.clear()
        if len(young) >= self.max_blocks // 2:
            self._rotate()

    def _drop_bit(self, bit: int, slot: int, hashes: Iterable[int]) -> None:
        young, old, pred, intern = self._young, self._old, self._predicted, self._intern
        dropped = 0
        for h in hashes:
            gen = young if h in young else old
            m = gen.get(h, 0)
            if not m & bit:
                continue
            dropped += 1
            m &= ~bit
            if m:
                gen[h] = intern.setdefault(m, m)
            else:
                del gen[h]
            p = pred.get(h, 0)
            if p & bit:
                p &= ~bit
                if p:
                    pred[h] = p
                else:
                    del pred[h]
        if dropped:
            self._counts[slot] = max(self._counts[slot] - dropped, 0)
            self._changed.add(slot)

    def _rotate(self) -> None:
        """The young generation is full: drop the old one, the young one becomes old."""
        gone, self._old, self._young = self._old, self._young, {}
        counts = self._counts
        for m, n in Counter(gone.values()).items():
            while m:
                low = m & -m
                counts[low.bit_length() - 1] -= n
                self._changed.add(low.bit_length() - 1)
                m ^= low
        pred = self._predicted
        for h in [h for h in pred if h in gone]:
            del pred[h]
        self.evicted += len(gone)
        log.debug("kv_index_rotated", forgotten=len(gone), held=len(self._old))

    # ------------------------------------------------------------------ lookup

    def match(self, hashes: Sequence[int]) -> PrefixMatch:
        """The longest prefix of `hashes` each location holds, in blocks.

        Caches are prefix-closed (a block is only usable after its whole prefix, vLLM evicts
        a chain tail first, and every update here adds or drops a chain's suffix), so the
        set of locations holding block i only shrinks with i: each boundary is found by
        bisection, O(levels * log(blocks)) lookups instead of one per block.
        """
        y, o = self._young.get, self._old.get
        n = len(hashes)
        m = (y(hashes[0]) or o(hashes[0], 0)) if n else 0
        if not m:
            return _EMPTY
        named = self._named
        out: dict[str, int] = {}
        levels: list[tuple[int, tuple[str, ...]]] = []
        lo = 0
        while True:  # blocks lo.. are held by every location in m: bisect where that ends
            ok, hi = lo, n
            while hi - ok > 1:
                mid = (ok + hi) >> 1
                if (y(h := hashes[mid]) or o(h, 0)) & m == m:
                    ok = mid
                else:
                    hi = mid
            if hi >= n:
                levels.append((n, names := named.get(m) or self._name(m)))
                out.update(dict.fromkeys(names, n))
                break
            rest = (y(h := hashes[hi]) or o(h, 0)) & m
            gone = m & ~rest
            levels.append((hi, names := named.get(gone) or self._name(gone)))
            out.update(dict.fromkeys(names, hi))
            if not rest:
                break
            m, lo = rest, hi
        levels.reverse()
        return PrefixMatch(pool=out.pop(POOL, 0), local=out, longest=n if hi >= n else hi,
                           levels=tuple(levels))


    def _name(self, bits: int) -> tuple[str, ...]:
        """The names of the locations in `bits`, remembered (bounded) for the next lookup."""
        names = self._names
        out = []
        for base, byte in enumerate(bits.to_bytes((bits.bit_length() + 7) // 8, "little")):
            if byte:
                out += [n for i in _BITS[byte] if (n := names[base * 8 + i]) is not None]
        if len(self._named) >= _INTERN_MAX:
            self._named.clear()
        self._named[bits] = found = tuple(out)
        return found


_BITS = tuple(tuple(i for i in range(8) if b >> i & 1) for b in range(256))
"""The set bits of every byte value."""
