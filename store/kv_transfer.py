"""The KV connector's data path: whole blocks between a registered paged KV cache and the pool.

No vLLM import here: `benchmarks.bench_kv` and tests drive the same code as the connector.
`BlockLayout` finds where each block lives for any backend's layout; `KVTransfer` saves
(after a `batch_is_exist` dedup check) and loads blocks with the pool's zero-copy calls and
counts what happened (`TransferStats`).
"""

from __future__ import annotations

import bisect
import ctypes
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import structlog
import torch

from store.checksum import Digests
from store.pool import Fences, PoolError, ZeroCopyPool

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class BlockLayout:
    """Where every block of a paged KV cache lives in memory, for any backend's layout.

    Per layer, the dimension that indexes blocks is found by size (`_block_dim`); block `b` of
    a layer starts `b * stride` bytes after block 0, and block 0's slice is cut into the fewest
    contiguous pieces (one on CPU, where the block dim is first; K and V apart for
    FlashAttention's [2, num_blocks, ...]). A block's object is the concatenation of those
    pieces over all layers, in layer order, i.e. `torch.cat([t.select(d, b).flatten()...])`.
    """

    bases: tuple[int, ...]
    strides: tuple[int, ...]
    pieces: tuple[tuple[tuple[int, int], ...], ...]
    """Per layer, (offset from the block's start, nbytes) of each contiguous piece."""
    regions: tuple[tuple[int, int], ...]
    """(address, nbytes) of the memory to register: the layers' storages, merged."""
    num_blocks: int
    device: str

    @classmethod
    def of(cls, layers: Sequence[torch.Tensor], num_blocks: int) -> BlockLayout:
        if not layers:
            raise ValueError("no KV cache layers")
        bases, strides, pieces, spans = [], [], [], []
        for t in layers:
            d = block_dim(t, num_blocks)
            es = t.element_size()
            block0 = t.select(d, 0)
            base = block0.data_ptr()
            bases.append(base)
            strides.append(t.stride(d) * es)
            pieces.append(tuple((a - base, n) for a, n in _contiguous_pieces(block0)))
            storage = t.untyped_storage()
            spans.append((storage.data_ptr(), storage.nbytes()))
        return cls(tuple(bases), tuple(strides), tuple(pieces), _merge(spans), num_blocks,
                   layers[0].device.type)

    @property
    def block_nbytes(self) -> int:
        return sum(n for layer in self.pieces for _, n in layer)

    def ranges(self, block_id: int) -> list[tuple[int, int]]:
        """(address, nbytes) pieces of one block's object, in object order."""
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} out of [0, {self.num_blocks})")
        return [
            (base + block_id * stride + off, n)
            for base, stride, layer in zip(self.bases, self.strides, self.pieces, strict=True)
            for off, n in layer
        ]


def _piece_views(layout: BlockLayout) -> list[tuple[np.ndarray, int, int]]:
    """Per piece of the object format: a [num_blocks, nbytes] uint8 view of that piece in every
    block of the cache, its offset in the object, and its size."""
    views, src = [], 0
    for base, stride, pieces in zip(layout.bases, layout.strides, layout.pieces, strict=True):
        for off, n in pieces:
            span = (layout.num_blocks - 1) * stride + n
            raw = np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(base + off))
            views.append((np.lib.stride_tricks.as_strided(raw, (layout.num_blocks, n),
                                                           (stride, 1)), src, n))
            src += n
    return views


def _contiguous_pieces(t: torch.Tensor) -> list[tuple[int, int]]:
    """(address, nbytes) runs covering `t` in logical order; adjacent runs merged."""
    if t.is_contiguous():
        runs = [(t.data_ptr(), t.numel() * t.element_size())]
    else:
        runs = [r for i in range(t.shape[0]) for r in _contiguous_pieces(t[i])]
    merged: list[tuple[int, int]] = []
    for a, n in runs:
        if merged and merged[-1][0] + merged[-1][1] == a:
            merged[-1] = (merged[-1][0], merged[-1][1] + n)
        else:
            merged.append((a, n))
    return merged


def _merge(spans: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for a, n in sorted(spans):
        if out and a <= out[-1][0] + out[-1][1]:
            end = max(out[-1][0] + out[-1][1], a + n)
            out[-1] = (out[-1][0], end - out[-1][0])
        else:
            out.append((a, n))
    return tuple(out)


LATENCY_BOUNDS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""Upper bounds of the save and load batch latency buckets (`TransferStats.*_buckets`)."""


def _no_buckets() -> tuple[int, ...]:
    return (0,) * (len(LATENCY_BOUNDS_S) + 1)


def _bucketed(buckets: tuple[int, ...], seconds: float) -> tuple[int, ...]:
    i = bisect.bisect_left(LATENCY_BOUNDS_S, seconds)
    return buckets[:i] + (buckets[i] + 1,) + buckets[i + 1:]


@dataclass
class TransferStats:
    """Cumulative counters of one process's KV transfers (blocks, bytes, seconds).

    The `*_buckets` count batches by latency: entry i those taking at most
    `LATENCY_BOUNDS_S[i]` (and more than the bound before), the last one those above every
    bound; not cumulative, so that `add` sums them element by element."""

    blocks_written: int = 0
    bytes_written: int = 0
    blocks_deduplicated: int = 0
    """Blocks a save found already in the pool (written by anyone, any time) and skipped."""
    save_skipped_full: int = 0
    save_failed: int = 0
    """Blocks not saved for any other reason: pool unavailable, errors."""
    blocks_saved_generated: int = 0
    """Of `blocks_written`, blocks of generated tokens (`KVTransfer.save(generated=True)`)."""
    save_batches: int = 0
    save_seconds: float = 0.0
    save_buckets: tuple[int, ...] = field(default_factory=_no_buckets)
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    load_failed: int = 0
    """Blocks whose load failed after the lookup promised them: vLLM recomputes them."""
    checksum_failed: int = 0
    """Of `load_failed`, blocks that arrived whole but did not match their digest."""
    load_batches: int = 0
    load_seconds: float = 0.0
    load_buckets: tuple[int, ...] = field(default_factory=_no_buckets)
    held_abandoned: int = 0
    """Requests whose blocks a pool call given up on kept allocated until it returned."""
    held_abandoned_seconds: float = 0.0
    """Their seconds from the call being given up on to its return."""
    held_preempted: int = 0
    """Preemptions whose step waited for a save that could still read the request's blocks
    (vLLM had freed them already), the engine stalled meanwhile."""
    held_preempted_seconds: float = 0.0

    def add(self, other: TransferStats) -> TransferStats:
        return TransferStats(**{k: _plus(v, getattr(other, k)) for k, v in asdict(self).items()})


def _plus(a: float | tuple[int, ...], b: float | tuple[int, ...]) -> float | tuple[int, ...]:
    if isinstance(a, tuple):
        return tuple(x + y for x, y in zip(a, b, strict=True))
    return a + b


@dataclass(frozen=True)
class SaveResult:
    written: int
    deduplicated: int
    full: int
    failed: int


class KVTransfer:
    """Moves whole blocks between a registered paged KV cache and a `ZeroCopyPool`: the one
    data path of the connector (and of `benchmarks.bench_kv`). Thread-safe; never raises for
    pool trouble (results say what happened, `stats` counts it)."""

    def __init__(self, layout: BlockLayout, pool: Callable[[], ZeroCopyPool | None], *,
                 staging_blocks: int = 0, checksum: bool = False) -> None:
        """`staging_blocks` > 0 (host memory only): loads land in a registered staging buffer
        of that many blocks, one contiguous range per object, and are scattered into the cache
        by numpy (one vectorized copy per layer piece and batch). Not zero-copy, but Mooncake's
        TCP transport moves one range per object instead of one per layer piece, which is what
        limits it with small pieces (docs/design.md, "Moving KV"). 0: straight into the cache.
        `checksum`: every object carries its block's digest, verified on load
        (`store.checksum`; host memory only)."""
        if checksum and layout.device != "cpu":
            raise ValueError(f"KV checksums need the cache in host memory, not {layout.device}")
        self.layout = layout
        self.checksum = checksum
        self._sums: Digests | None = None
        """Per block id of the cache, the digest slot its object carries."""
        self._stage_sums: Digests | None = None
        self._pool_source = pool
        self._registered: ZeroCopyPool | None = None
        self._lock = threading.Lock()
        self.stats = TransferStats()
        self._stage: np.ndarray | None = None
        self._stage_lock = threading.Lock()
        self._stage_fences: Fences = []
        self._views: list[tuple[np.ndarray, int, int]] = []
        if staging_blocks > 0 and layout.device == "cpu":
            self._stage = np.zeros((staging_blocks, layout.block_nbytes), dtype=np.uint8)
            self._views = _piece_views(layout)

    def _pool(self) -> ZeroCopyPool | None:
        pool = self._pool_source()
        if pool is None:
            return None
        with self._lock:
            if self._registered is not pool:
                regions = list(self.layout.regions)
                if self._stage is not None:
                    regions.append((self._stage.ctypes.data, self._stage.nbytes))
                try:
                    if self.checksum:
                        self._sums = Digests(self.layout.num_blocks, pool)
                        regions.append(self._sums.region)
                        if self._stage is not None:
                            self._stage_sums = Digests(len(self._stage), pool)
                            regions.append(self._stage_sums.region)
                    for addr, nbytes in regions:
                        pool.register_memory(addr, nbytes)
                except PoolError as e:
                    log.warning("kv_register_failed", error=str(e), fallback="recompute")
                    return None
                self._registered = pool
        return pool

    def healthy(self) -> bool:
        """The pool can be reached now (as far as its client knows)."""
        pool = self._pool()
        return pool is not None and pool.healthy()

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Which of `keys` the pool holds now (all False without a pool)."""
        pool = self._pool()
        if pool is None or not keys:
            return [False] * len(keys)
        try:
            return pool.exists(list(keys))
        except PoolError:
            return [False] * len(keys)

    def connect(self) -> bool:
        """Join the pool and register the cache, if the pool can be reached now."""
        return self._pool() is not None

    def save(self, keys: Sequence[str], block_ids: Sequence[int], *, near: str | None = None,
             generated: bool = False, fences: Fences | None = None) -> SaveResult:
        """Write the blocks the pool does not hold yet. `near`: the key of a pooled block whose
        segment these blocks should go to (default placement when it is not found);
        `generated`: count them as blocks of generated tokens; `fences`: calls given up on
        that may still read the blocks (`ZeroCopyPool.get_into`)."""
        t0 = time.perf_counter()
        pool = self._pool()
        n = len(keys)
        if pool is None:
            return self._count_save(SaveResult(0, 0, 0, n), 0, t0, generated)
        present = pool.exists(list(keys)) if n else []
        todo = [i for i in range(n) if not present[i]]
        if not todo:
            return self._count_save(SaveResult(0, n, 0, 0), 0, t0, generated)
        segment = pool.segment_of(near) if near is not None else None
        ids = [block_ids[i] for i in todo]
        objects = self._objects(ids)
        if self._sums is not None:
            for b, obj in zip(ids, objects, strict=True):
                self._sums.seal(b, obj[:-1])
        report = pool.put_from([keys[i] for i in todo], objects, segment=segment,
                               fences=fences)
        result = SaveResult(report.written, n - len(todo), report.full,
                            report.failed + report.unavailable)
        return self._count_save(result, report.written * self.layout.block_nbytes, t0,
                                generated)

    def _count_save(self, r: SaveResult, nbytes: int, t0: float,
                    generated: bool = False) -> SaveResult:
        with self._lock:
            s = self.stats
            s.blocks_written += r.written
            if generated:
                s.blocks_saved_generated += r.written
            s.bytes_written += nbytes
            s.blocks_deduplicated += r.deduplicated
            s.save_skipped_full += r.full
            s.save_failed += r.failed
            s.save_batches += 1
            seconds = time.perf_counter() - t0
            s.save_seconds += seconds
            s.save_buckets = _bucketed(s.save_buckets, seconds)
        return r

    def load(self, keys: Sequence[str], block_ids: Sequence[int], *,
             fences: Fences | None = None) -> list[bool]:
        """Read blocks into the cache; False where a block did not arrive whole (its memory
        then holds garbage and must be recomputed). `fences`: calls given up on that may
        still write the blocks (`ZeroCopyPool.get_into`; a staged load's late calls write
        the staging buffer, which is not used again until they are done)."""
        t0 = time.perf_counter()
        pool = self._pool()
        if pool is None or not keys:
            ok = [False] * len(keys)
        elif self._stage is not None:
            ok = self._load_staged(pool, keys, block_ids)
        else:
            objects = self._objects(block_ids)
            ok = pool.get_into(list(keys), objects, fences=fences)
            if self._sums is not None:
                ok = self._verified(ok, [(b, obj[:-1]) for b, obj in zip(block_ids, objects,
                                                                           strict=True)],
                                    self._sums)
        loaded = sum(ok)
        seconds = time.perf_counter() - t0
        with self._lock:
            s = self.stats
            s.blocks_loaded += loaded
            s.bytes_loaded += loaded * self.layout.block_nbytes
            s.load_failed += len(ok) - loaded
            s.load_batches += 1
            s.load_seconds += seconds
            s.load_buckets = _bucketed(s.load_buckets, seconds)
        return ok

    def _objects(self, block_ids: Sequence[int]) -> list[list[tuple[int, int]]]:
        """Per block, the ranges of its object: its pieces, then (with checksums) its digest
        slot, which `[:-1]` leaves out again."""
        sums = self._sums
        if sums is None:
            return [self.layout.ranges(b) for b in block_ids]
        return [[*self.layout.ranges(b), sums.slot(b)] for b in block_ids]

    def _verified(self, ok: list[bool], blocks: Sequence[tuple[int, list[tuple[int, int]]]],
                  sums: Digests) -> list[bool]:
        """`ok`, False where what arrived (slot, ranges) does not match its digest."""
        out = [g and sums.verify(slot, ranges) for g, (slot, ranges) in zip(ok, blocks,
                                                                             strict=True)]
        bad = sum(ok) - sum(out)
        if bad:
            log.warning("kv_checksum_mismatch", blocks=bad, fallback="recompute")
            with self._lock:
                self.stats.checksum_failed += bad
        return out

    def _load_staged(self, pool: ZeroCopyPool, keys: Sequence[str],
                     block_ids: Sequence[int]) -> list[bool]:
        assert self._stage is not None
        stage, nbytes = self._stage, self.layout.block_nbytes
        base = stage.ctypes.data
        ok: list[bool] = []
        with self._stage_lock:
            self._stage_fences = [f for f in self._stage_fences if not f.done()]
            if self._stage_fences:  # a late call may still write the buffer: recompute
                return [False] * len(keys)
            for start in range(0, len(keys), len(stage)):
                ck = list(keys[start:start + len(stage)])
                spans = [[(base + i * nbytes, nbytes)] for i in range(len(ck))]
                sums = self._stage_sums
                got = pool.get_into(ck, [r + [sums.slot(i)] if sums else r
                                         for i, r in enumerate(spans)],
                                    fences=self._stage_fences)
                if self._stage_fences:  # given up on: what it wrote so far is not trusted
                    ok.extend([False] * (len(keys) - len(ok)))
                    break
                if sums is not None:
                    got = self._verified(got, list(enumerate(spans)), sums)
                rows = [i for i, g in enumerate(got) if g]
                if rows:
                    ids = [block_ids[start + i] for i in rows]
                    for view, src, n in self._views:
                        view[ids] = stage[rows, src:src + n]
                ok.extend(got)
        return ok

    def count_deduplicated(self, blocks: int) -> None:
        """Blocks a caller skipped because another save of the same batch covers them."""
        with self._lock:
            self.stats.blocks_deduplicated += blocks

    def count_held(self, seconds: float, *, preempted: bool) -> None:
        """Blocks kept `seconds` for a pool call on them: a preempted request's, or a request's
        that a call given up on may still touch."""
        with self._lock:
            s = self.stats
            if preempted:
                s.held_preempted += 1
                s.held_preempted_seconds += seconds
            else:
                s.held_abandoned += 1
                s.held_abandoned_seconds += seconds

    def snapshot(self) -> TransferStats:
        with self._lock:
            return TransferStats(**asdict(self.stats))


def block_dim(t: torch.Tensor, num_blocks: int) -> int:
    """The dimension of a per-layer KV tensor that indexes blocks (0 on CPU, 1 for
    FlashAttention's [2, num_blocks, ...]): the first whose size is the block count."""
    for d, size in enumerate(t.shape):
        if size == num_blocks:
            return d
    raise ValueError(f"no dimension of size num_blocks={num_blocks} in KV shape {tuple(t.shape)}")
