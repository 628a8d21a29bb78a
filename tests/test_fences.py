"""No pool call the pool gave up on lands in (or reads) blocks vLLM could give to another
request (`store.connector.fences`). The pool is `InMemoryPool` with `late` set: its calls
answer at once as failed and do their copies only when the test releases them, as a Mooncake
call abandoned after `op_timeout_s` that completes later would."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from conftest import wait_until
from structlog.testing import capture_logs

from store.connector.data import BlockTransfer, LoadJob, PoolConnectorMetadata
from store.connector.settings import ConnectorSettings
from store.connector.worker import WorkerSide
from store.kv_transfer import BlockLayout, KVTransfer
from store.pool import InMemoryPool

BLOCKS = 4
PATTERN = 7.0


class _Pool:
    def __init__(self, pool: InMemoryPool) -> None:
        self.pool = pool

    def get(self) -> InMemoryPool:
        return self.pool


def _layers() -> list[torch.Tensor]:
    return [torch.zeros(BLOCKS, 2, 32, 16) for _ in range(2)]


def _pooled(pool: InMemoryPool, key: str) -> None:
    """`key` in the pool, every value PATTERN (what a late load would write)."""
    src = [torch.full((BLOCKS, 2, 32, 16), PATTERN) for _ in range(2)]
    KVTransfer(BlockLayout.of(src, BLOCKS), lambda: pool).save([key], [0])


def _worker(pool: InMemoryPool) -> tuple[WorkerSide, list[torch.Tensor]]:
    settings = ConnectorSettings(master_addr="-", metadata_url="-", namespace="t",
                                 load_poll_s=0.001)
    side = WorkerSide(settings, _Pool(pool), saves=True)  # type: ignore[arg-type]
    layers = _layers()
    side.register_kv_caches({f"layer{i}": t for i, t in enumerate(layers)}, BLOCKS)
    return side, layers


@contextmanager
def _late_side(pooled: bool) -> Iterator[tuple[InMemoryPool, threading.Event, WorkerSide,
                                               list[torch.Tensor]]]:
    """A worker side over a late pool (key "k" in it if `pooled`): its calls copy only once the
    event is set, as the test does and this does on the way out, before the side shuts down."""
    pool = InMemoryPool()
    if pooled:
        _pooled(pool, "k")
    late = pool.late = threading.Event()
    side, layers = _worker(pool)
    try:
        yield pool, late, side, layers
    finally:
        late.set()
        side.shutdown()


def _finished(side: WorkerSide, finished: set[str]) -> tuple[set[str], set[str]]:
    sent, received = side.get_finished(finished)
    return sent or set(), received or set()


def test_a_load_given_up_on_is_reported_only_once_the_late_write_is_done():
    """Whatever the request kept valid: vLLM frees a request's blocks as its load reports if
    it kept none (`Scheduler._update_waiting_for_remote_kv`), or if it was aborted, which
    vLLM may take between a step's output and its processing, after the worker reported
    (tests/test_block_lifetime.py shows it on vLLM's scheduler). Meanwhile vLLM may learn
    which blocks failed; once reported, the request recomputes them."""
    with _late_side(pooled=True) as (_, late, side, layers):
        side.start_load_kv(PoolConnectorMetadata(loads=[LoadJob("A", ("k",), (1,))]))
        wait_until(lambda: side.fences.held("A"), 5)  # the loader gave up on its read
        for _ in range(3):
            assert _finished(side, set()) == (set(), set())
        assert 1 in side.invalid_blocks()  # vLLM may learn the failed block before the end
        assert float(layers[0][1].max()) == 0.0
        late.set()
        wait_until(lambda: float(layers[0][1].min()) == PATTERN, 5)
        received: set[str] = set()
        wait_until(lambda: received.update(_finished(side, set())[1]) or "A" in received, 5)
        result = side.worker_meta().loads["A"]
        assert (result.loaded, result.failed) == (0, 1)
        assert _finished(side, {"A"}) == (set(), set())  # its end needs no report
        assert side.transfer.stats.held_abandoned == 1
        assert side.transfer.stats.held_abandoned_seconds > 0


def test_a_withheld_load_whose_request_is_then_aborted_reports_once_done_and_once():
    with _late_side(pooled=True) as (_, late, side, layers):
        side.start_load_kv(PoolConnectorMetadata(loads=[LoadJob("A", ("k",), (1,))]))
        wait_until(lambda: side.fences.held("A"), 5)
        assert _finished(side, set()) == (set(), set())  # withheld: nothing valid
        side.start_load_kv(PoolConnectorMetadata(cancelled={"A"}))  # then aborted
        assert _finished(side, {"A"}) == (set(), set())
        late.set()
        received: set[str] = set()
        wait_until(lambda: received.update(_finished(side, set())[1]) or "A" in received, 5)
        assert _finished(side, set()) == (set(), set())
        assert not side._cancelled and not side._loading  # nothing left behind for it


def test_a_load_given_up_on_in_the_step_its_request_is_aborted_reports_once_done():
    """vLLM frees an aborted request's blocks as soon as its load reports (`finished_recving`),
    whatever the scheduler side says: the report waits for the late write."""
    with _late_side(pooled=True) as (_, late, side, layers):
        side.start_load_kv(PoolConnectorMetadata(loads=[LoadJob("A", ("k",), (1,))]))
        wait_until(lambda: side.fences.held("A"), 5)  # the loader gave up on its read ...
        # ... and in the step that takes its result, the request is aborted
        side.start_load_kv(PoolConnectorMetadata(cancelled={"A"}))
        for _ in range(3):
            assert _finished(side, {"A"}) == (set(), set())
        assert float(layers[0][1].max()) == 0.0
        late.set()
        wait_until(lambda: float(layers[0][1].min()) == PATTERN, 5)
        received: set[str] = set()
        wait_until(lambda: received.update(_finished(side, set())[1]) or "A" in received, 5)
        assert _finished(side, set()) == (set(), set())  # reported once, never as a save


def test_a_save_given_up_on_holds_its_blocks_until_the_late_read_is_done():
    """Freed too early, the block's next owner's KV would be stored under this key."""
    with _late_side(pooled=False) as (pool, late, side, layers):
        layers[0][2].fill_(3.0)
        layers[1][2].fill_(3.0)
        side.wait_for_save(PoolConnectorMetadata(saves=[BlockTransfer("S", ("s",), (2,))]))
        assert side.saver is not None
        wait_until(lambda: side.saver.pending("S") == 0, 5)  # the saver gave up
        for _ in range(3):
            assert _finished(side, {"S"})[0] == set()
        pool.late = None
        late.set()
        sent: set[str] = set()
        wait_until(lambda: sent.update(_finished(side, set())[0]) or "S" in sent, 5)
        assert pool.exists(["s"]) == [True]


def test_a_staged_load_given_up_on_keeps_the_staging_buffer_until_it_is_done():
    pool = InMemoryPool()
    _pooled(pool, "k")
    dst = _layers()
    transfer = KVTransfer(BlockLayout.of(dst, BLOCKS), lambda: pool, staging_blocks=2)
    late = pool.late = threading.Event()
    try:
        assert transfer.load(["k"], [0]) == [False]
        pool.late = None  # the pool answers again, but the buffer may still be written
        assert transfer.load(["k"], [1]) == [False]
        assert float(dst[0][1].max()) == 0.0
        late.set()
        wait_until(lambda: transfer.load(["k"], [1]) == [True], 5)
        assert float(dst[0][1].min()) == PATTERN
    finally:
        late.set()


def test_a_request_aborted_after_its_load_reported_is_never_reported_as_saved():
    """A request that saved blocks, was preempted and reloads them (its saves long done), is
    aborted just after the worker reported the load, before vLLM took that report: vLLM frees
    it as it takes the report, and a later report of its saves (`finished_sending`) would find
    no such request (vLLM asserts)."""
    with _late_side(pooled=True) as (_, late, side, _):
        late.set()
        side.pool.pool.late = None
        side.wait_for_save(PoolConnectorMetadata(saves=[BlockTransfer("A", ("s",), (2,))]))
        assert side.saver is not None
        wait_until(lambda: side.saver.pending("A") == 0, 5)
        side.handle_preemptions(PoolConnectorMetadata(preempted={"A"}))
        side.start_load_kv(PoolConnectorMetadata(loads=[LoadJob("A", ("k",), (1,))]))
        received: set[str] = set()
        wait_until(lambda: received.update(_finished(side, set())[1]) or "A" in received, 5)
        side.start_load_kv(PoolConnectorMetadata(cancelled={"A"}))  # the abort, one step on
        for finished in ({"A"}, set(), set()):
            assert _finished(side, finished) == (set(), set())
        assert not (side._saving or side._finishing or side._cancelled or side._loading)


def test_a_request_aborted_while_it_reloads_is_reported_by_its_load_alone():
    """As above, aborted while the load runs: its saves' report would free the blocks the
    load writes; the load's report, once it is done, is the request's only one."""
    class Stalls(InMemoryPool):
        entered = threading.Event()

        def _stalled(self) -> None:
            if self.stall is not None:
                self.entered.set()
            super()._stalled()

    pool = Stalls()
    _pooled(pool, "k")
    side, layers = _worker(pool)
    stall = threading.Event()
    try:
        side.wait_for_save(PoolConnectorMetadata(saves=[BlockTransfer("A", ("s",), (2,))]))
        assert side.saver is not None
        wait_until(lambda: side.saver.pending("A") == 0, 5)
        side.handle_preemptions(PoolConnectorMetadata(preempted={"A"}))
        pool.stall = stall
        side.start_load_kv(PoolConnectorMetadata(loads=[LoadJob("A", ("k",), (1,))]))
        assert pool.entered.wait(5)  # the read runs ...
        side.start_load_kv(PoolConnectorMetadata(cancelled={"A"}))  # ... as A is aborted
        for finished in ({"A"}, set(), set()):
            assert _finished(side, finished) == (set(), set())
        stall.set()
        wait_until(lambda: float(layers[0][1].min()) == PATTERN, 5)
        received: set[str] = set()
        wait_until(lambda: received.update(_finished(side, set())[1]) or "A" in received, 5)
        assert _finished(side, set()) == (set(), set())
        assert not (side._saving or side._finishing or side._cancelled or side._loading)
    finally:
        stall.set()
        side.shutdown()


def test_a_preemption_waits_for_a_save_given_up_on_past_any_bound_and_says_so(monkeypatch):
    import store.connector.worker as worker

    monkeypatch.setattr(worker, "STILL_WAITING_LOG_S", 0.05)
    with _late_side(pooled=False) as (_, late, side, _), capture_logs() as logs:
        side.wait_for_save(PoolConnectorMetadata(saves=[BlockTransfer("S", ("s",), (2,))]))
        wait_until(lambda: side.fences.held("S"), 5)  # the saver gave up on its write
        step = threading.Thread(target=side.handle_preemptions,
                                args=(PoolConnectorMetadata(preempted={"S"}),), daemon=True)
        step.start()
        step.join(0.5)
        assert step.is_alive()
        assert sum(e["event"] == "kv_preempt_waiting_for_pool" for e in logs) >= 3
        late.set()
        step.join(5)
        assert not step.is_alive()
        assert side.transfer.stats.held_preempted == 1
