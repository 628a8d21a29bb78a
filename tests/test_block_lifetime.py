"""No pool call outlives the blocks it reads or writes, whatever vLLM does to their request
meanwhile, on vLLM's own scheduler (`tests/stepped_engine.py`): a preempted request's blocks,
which vLLM hands to the next request at once, are written by nobody before its saves have
read them; a request aborted as its load reports keeps its blocks until a read given up on
has landed. The pool is `InMemoryPool` with a gate: `stall` (a slow call the pool waits for)
or `late` (a call the pool gave up on, which still copies once released)."""

from __future__ import annotations

import threading

import pytest
from stepped_engine import BLOCK, SteppedEngine

import store.connector.worker as worker_module
from store.pool import InMemoryPool

pytestmark = pytest.mark.timeout(300)

BLOCKED_S = 0.5
"""How long a step is seen blocked before the test releases the pool call it waits for."""


@pytest.fixture(autouse=True)
def no_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that gives up waiting after a fixed time (it did: `_PREEMPT_WAIT_S`, 30 s)
    would show it here within `BLOCKED_S`."""
    monkeypatch.setattr(worker_module, "_PREEMPT_WAIT_S", BLOCKED_S / 5, raising=False)


def _prompt(seed: int, blocks: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 1900 + 50 for i in range(blocks * BLOCK)]


def _engine(model_dir: str, pool: InMemoryPool, num_blocks: int) -> SteppedEngine:
    return SteppedEngine(model_dir, pool, num_blocks)


def _drain(engine: SteppedEngine) -> None:
    engine.run(lambda: not engine.scheduler.requests)
    assert engine.leaks() == []


def _in_thread(fn, *args) -> threading.Thread:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn(*args)
        except BaseException as e:  # re-raised by the test through `errors`
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.errors = errors  # type: ignore[attr-defined]
    thread.start()
    return thread


def _joined(thread: threading.Thread) -> None:
    thread.join(10)
    assert not thread.is_alive()
    if thread.errors:  # type: ignore[attr-defined]
        raise thread.errors[0]  # type: ignore[attr-defined]


@pytest.mark.parametrize("gate", ["stall", "late"])
def test_a_preempted_requests_blocks_are_written_only_after_its_saves_read_them(
        model_dir: str, gate: str) -> None:
    """X and Y decode until the cache is full; X's next block preempts Y, and vLLM gives X
    Y's blocks in that very step. Y's saves (a slow one, or one the pool gave up on) have not
    read them yet: the step waits for them before X's forward pass writes there, however long,
    and no object in the pool is another request's KV."""
    pool = InMemoryPool()
    engine = _engine(model_dir, pool, num_blocks=9)  # 8 usable: 4 each at 64 tokens
    engine.add("X", _prompt(1, 3), max_tokens=40)
    engine.add("Y", _prompt(2, 3), max_tokens=40)
    release = threading.Event()
    while True:
        out = engine.schedule()
        y = engine.scheduler.requests["Y"]
        if y.num_computed_tokens + 1 >= 4 * BLOCK and getattr(pool, gate) is None:
            setattr(pool, gate, release)  # Y's last full block is saved in this step
        if out.preempted_req_ids:
            break
        engine.execute(out)
    assert out.preempted_req_ids == {"Y"}
    step = _in_thread(engine.execute, out)
    step.join(BLOCKED_S)
    assert step.is_alive(), "Y's blocks went to X while its save could still read them"
    release.set()
    _joined(step)
    setattr(pool, gate, None)
    _drain(engine)
    assert engine.wrong_objects() == []
    assert len(pool) >= 8  # both prompts' blocks and their first generated ones
    assert engine.worker.transfer.stats.held_preempted == 1
    assert engine.worker.transfer.stats.held_preempted_seconds >= BLOCKED_S


class _Landing(InMemoryPool):
    """Records, as each read lands, which requests vLLM's scheduler gives the blocks it writes
    (`owners`)."""

    def __init__(self) -> None:
        super().__init__()
        self.engine: SteppedEngine | None = None
        self.landed_in: list[set[str]] = []
        self.landed = threading.Event()

    def _get_now(self, keys, ranges):  # type: ignore[no-untyped-def]
        if self.engine is not None:
            layout = self.engine.worker.transfer.layout  # type: ignore[union-attr]
            block_of = {layout.ranges(b)[0][0]: b for b in range(layout.num_blocks)}
            self.landed_in = [self.engine.owners(block_of[r[0][0]]) for r in ranges]
        ok = super()._get_now(keys, ranges)
        self.landed.set()
        return ok


def _loading_with_a_local_hit(model_dir: str) -> tuple[_Landing, SteppedEngine, threading.Event]:
    """R's first block is in the engine's own cache, its next three only in the pool: R loads
    them, and the pool gives up on the read (it lands once the event is set)."""
    pool = _Landing()
    engine = _engine(model_dir, pool, num_blocks=16)
    pool.engine = engine
    prompt = _prompt(3, 4)
    engine.pooled(prompt)
    engine.add("A", prompt[:BLOCK + 5], max_tokens=1)  # computes block 0 here
    _drain(engine)
    late = pool.late = threading.Event()
    pool.landed.clear()
    engine.add("R", prompt + [7, 8, 9], max_tokens=4)
    engine.run(lambda: engine.worker.fences.held("R"))  # the loader gave up on R's read
    return pool, engine, late


def test_a_request_aborted_as_its_load_reports_keeps_its_blocks_until_the_read_landed(
        model_dir: str) -> None:
    """vLLM takes an abort between a step's worker output and `update_from_output`
    (`EngineCore._process_aborts_queue`): a load reported in that step while a read given up on
    can still land would have its blocks freed by that very report. R's load is reported only
    once the read has landed, in R's own blocks."""
    pool, engine, late = _loading_with_a_local_hit(model_dir)
    held = engine.block_ids("R")
    engine.step(aborts={"R"})
    for _ in range(3):
        assert engine.block_ids("R") == held, "R's blocks freed while its read could land"
        engine.step()
    late.set()
    assert pool.landed.wait(10)
    assert pool.landed_in == [{"R"}] * 3
    pool.late = None
    _drain(engine)
    assert engine.wrong_objects() == []


def test_a_load_given_up_on_is_reported_once_its_read_landed_then_recomputed(
        model_dir: str) -> None:
    """Not aborted: R waits for the read, then computes what it did not load."""
    pool, engine, late = _loading_with_a_local_hit(model_dir)
    for _ in range(3):
        engine.step()
        assert engine.scheduler.requests["R"].status.name == "WAITING_FOR_REMOTE_KVS"
    late.set()
    assert pool.landed.wait(10)
    assert pool.landed_in == [{"R"}] * 3
    pool.late = None
    _drain(engine)
    assert len(engine.outputs["R"]) == 4
    assert engine.wrong_objects() == []


def test_a_finished_requests_blocks_stay_until_its_stalled_save_read_them(
        model_dir: str) -> None:
    pool = InMemoryPool()
    engine = _engine(model_dir, pool, num_blocks=16)
    release = pool.stall = threading.Event()
    engine.add("R", _prompt(4, 2), max_tokens=1)  # finishes in the step that saves
    engine.step()
    held = engine.block_ids("R")
    assert held
    for _ in range(3):
        engine.step()
        assert engine.block_ids("R") == held
    release.set()
    _drain(engine)
    assert len(pool) == 2 and engine.wrong_objects() == []


def test_a_request_aborted_while_it_reloads_after_preemption_keeps_its_blocks_until_the_load_ends(
        model_dir: str) -> None:
    """Y saved blocks, was preempted, X took its blocks (and their cache entries), and Y,
    resumed, loads its prefix back from the pool. Aborted while that read runs, Y is freed by
    vLLM as its load reports (it is waiting for remote KV), never by its saves' report, which
    would come first (its saves are long done) and free blocks the read is writing."""
    pool = _Landing()
    engine = _engine(model_dir, pool, num_blocks=9)
    pool.engine = engine
    engine.add("X", _prompt(5, 3), max_tokens=72)  # ends holding all 8 blocks
    engine.add("Y", _prompt(6, 3), max_tokens=40)
    engine.run(lambda: "Y" in engine.preempted)
    engine.run(lambda: "X" not in engine.scheduler.requests)
    release = pool.stall = threading.Event()
    pool.landed.clear()
    engine.run(lambda: engine.scheduler.requests["Y"].status.name == "WAITING_FOR_REMOTE_KVS")
    held = engine.block_ids("Y")
    engine.step(aborts={"Y"})
    for _ in range(3):
        assert engine.block_ids("Y") == held, "Y's blocks freed while its load could write them"
        engine.step()
    release.set()
    assert pool.landed.wait(10)
    assert pool.landed_in == [{"Y"}] * 2
    pool.stall = None
    _drain(engine)
    assert engine.wrong_objects() == []
