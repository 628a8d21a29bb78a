"""`worker.step_budget`: while streams run, a step's tokens fit a target time by the engine's own
learned step cost and shrink with the context its prompt chunk attends to; while none does, a
step gets the engine's whole budget; a step that finishes a prompt carries no other's chunk."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from worker.step_budget import (
    MIN_CHUNK,
    StepCost,
    budget,
    install,
    install_control,
    install_finish_first,
    set_target,
)


def test_the_budget_halves_at_the_given_context_and_never_starves_a_stream():
    assert budget(256, 0, 2000, 0) == 256
    assert budget(256, 2000, 2000, 0) == 128
    assert budget(256, 6000, 2000, 0) == 64
    assert budget(256, 6000, 2000, 100) == 100 + MIN_CHUNK  # every stream's token, and a chunk
    assert budget(64, 0, 2000, 100) == 64  # never above the configured budget


@dataclass
class _Req:
    num_computed_tokens: int
    num_prompt_tokens: int


@dataclass
class _Out:
    total_num_scheduled_tokens: int


@dataclass
class _Scheduler:
    """vLLM's `Scheduler` as the budget sees it: it schedules the whole budget."""
    max_num_scheduled_tokens: int = 2048
    running: list = field(default_factory=list)
    seen: list = field(default_factory=list)
    updated: list = field(default_factory=list)

    def schedule(self, wanted: int = 10**9) -> _Out:
        self.seen.append(self.max_num_scheduled_tokens)
        return _Out(min(self.max_num_scheduled_tokens, wanted))

    def update_from_output(self, out: _Out, model_output: object) -> str:
        self.updated.append(out)
        return "outputs"


def test_a_step_beside_streams_gets_the_budget_of_its_longest_running_prompt():
    cls = type("Sched", (_Scheduler,), {})
    install(2000, 256, cls)
    install(1000, 64, cls)  # idempotent: the first stays
    s = cls()
    s.running = [_Req(2000, 3000), _Req(500, 3000), _Req(40, 20)]  # two prompts, one stream
    s.schedule()
    s.running = [_Req(3000, 3000)]  # its prompt done: a stream
    s.schedule()
    assert s.seen == [128, 256]


def test_a_step_with_no_stream_to_hold_up_gets_the_engines_whole_budget():
    cls = type("Sched", (_Scheduler,), {})
    install(2000, 256, cls)
    s = cls()
    s.schedule()  # nothing running
    s.running = [_Req(0, 3000), _Req(0, 3000)]  # prompts only
    s.schedule()
    s.running = [_Req(2000, 3000), _Req(0, 3000), _Req(3000, 3000)]  # deep in one; a stream
    s.schedule()
    s.running = [_Req(0, 3000)]  # it ended
    s.schedule()
    assert s.seen == [2048, 2048, 128, 2048]


def test_a_step_that_finishes_a_prompt_carries_no_other_prompts_chunk():
    cls = type("Sched", (_Scheduler,), {})
    install(2000, 256, cls)
    s = cls()
    s.running = [_Req(2048, 2252), _Req(0, 2242)]  # the first's last 204 tokens, alone
    s.schedule()
    s.running = [_Req(2040, 2048), _Req(0, 2242)]  # 8 left: a chunk of at least MIN_CHUNK
    s.schedule()
    s.running = [_Req(1000, 3000), _Req(3000, 3000), _Req(3000, 3000)]  # beside two streams
    s.schedule()
    s.running = [_Req(2990, 3000), _Req(3000, 3000), _Req(3000, 3000)]
    s.schedule()
    assert s.seen == [204, MIN_CHUNK, 170, 2 + MIN_CHUNK]


def test_the_streams_budget_never_exceeds_the_engines():
    cls = type("Sched", (_Scheduler,), {})
    install(2000, 256, cls)
    s = cls(max_num_scheduled_tokens=64)
    s.running = [_Req(0, 3000), _Req(40, 20)]
    s.schedule()
    assert s.seen == [64]


def test_the_step_cost_is_learned_from_decode_steps_and_prompt_steps():
    cost = StepCost(2000)
    assert cost.tokens(50, 0) is None  # nothing timed yet
    cost.observe(10, 0, 0)  # streams alone: the fixed cost
    cost.observe(20, 8, 0)  # too few prompt tokens to teach the per-token cost
    assert cost.tokens(50, 0) is None
    cost.observe(130, 256, 2000)  # 120 ms for 256 tokens at twice the cost of none
    assert cost.fixed_ms == 10 and abs(cost.unit_ms - 120 / 512) < 1e-9
    assert cost.tokens(50, 0) == 170 and cost.tokens(50, 2000) == 85
    assert cost.tokens(5, 0) == 0  # the fixed cost alone passes the target


def test_beside_streams_a_step_takes_what_fits_the_target_once_the_engine_has_timed_one():
    clock = iter([0.0, 0.015625, 1.0, 1.140625, 2.0])  # decode step 15.625 ms, 256 tokens 140.625
    cls = type("Sched", (_Scheduler,), {})
    install(2000, 256, cls, target_ms=50, clock=lambda: next(clock))
    s = cls()
    s.running = [_Req(3000, 3000)]  # one stream
    s.update_from_output(s.schedule(1), None)  # a decode step alone: 15.625 ms
    s.running.append(_Req(0, 3000))  # a prompt joins at no context
    assert s.update_from_output(s.schedule(257), None) == "outputs"  # untimed: 256 + 1, 140.625 ms
    s.running[1] = _Req(2000, 3000)  # deep into it
    s.schedule(1000)
    assert s.seen == [256, 256, 1 + 35]  # (50 - 15.6) ms / (125 / 256 ms * 2) a token; the stream
    assert len(s.updated) == 2


def test_a_new_target_holds_from_the_next_step_and_only_where_there_is_a_budget():
    clock = iter([0.0, 0.015625, 1.0, 1.140625, 2.0, 3.0])
    cls = type("Sched", (_Scheduler,), {})
    install(2000, 256, cls, target_ms=50, clock=lambda: next(clock))
    s = cls()
    s.running = [_Req(3000, 3000)]
    s.update_from_output(s.schedule(1), None)  # decode alone: 15.625 ms
    s.running.append(_Req(0, 3000))
    s.update_from_output(s.schedule(257), None)  # 256 prompt tokens: 125 ms beyond it
    s.running[1] = _Req(2000, 3000)
    assert set_target(s, 100) == 100.0  # the TBT SLO doubled
    s.schedule(1000)
    assert s.seen[-1] == 1 + 86  # (100 - 15.6) ms / (125 / 256 ms * 2) a token
    assert set_target(_Scheduler(), 100) is None  # no step budget installed: nothing to set
    with pytest.raises(ValueError):
        set_target(s, 0)


def test_the_engine_core_utility_sets_its_schedulers_target():
    cls = type("Sched", (_Scheduler,), {})
    install(2000, 256, cls, target_ms=50)
    core_cls = type("EngineCore", (), {})
    install_control(core_cls)
    core = core_cls()
    core.scheduler = cls()
    assert core.kvcluster_step_target(75.0) == 75.0
    assert core.scheduler._kvcluster_target_ms == 75.0


@dataclass
class _Waiting:
    num_prompt_tokens: int
    num_computed_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens


class _Queue:
    def __init__(self, *reqs: _Waiting) -> None:
        self.reqs = list(reqs)

    def __bool__(self) -> bool:
        return bool(self.reqs)

    def __len__(self) -> int:
        return len(self.reqs)

    def peek_request(self) -> _Waiting:
        return self.reqs[0]

    def pop_request(self) -> _Waiting:
        return self.reqs.pop(0)


@dataclass
class _Admitting(_Scheduler):
    """vLLM's `Scheduler` with its waiting loop: running requests first, then waiting ones in
    order while budget is left and the queue answers non-empty."""
    waiting: _Queue = field(default_factory=_Queue)
    kv_holding_waiting: _Queue = field(default_factory=_Queue)
    took: list = field(default_factory=list)

    def schedule(self, wanted: int = 10**9) -> _Out:
        budget = self.max_num_scheduled_tokens
        self.seen.append(budget)
        for r in self.running:
            take = min(r.num_prompt_tokens - r.num_computed_tokens or 1, budget)
            budget -= take
        while budget > 0:
            queue = self.kv_holding_waiting or self.waiting
            if not queue:
                break
            r = queue.pop_request()
            take = min(r.num_tokens - r.num_computed_tokens, budget)
            budget -= take
            self.took.append(take)
            self.running.append(r)
        return _Out(self.max_num_scheduled_tokens - budget)


def test_a_prompt_admitted_from_the_queue_is_followed_only_by_prompts_that_ride_along():
    cls = type("Sched", (_Admitting,), {})
    install(2000, 256, cls)
    s = cls()
    s.waiting = _Queue(_Waiting(1000), _Waiting(1000))  # two cold prompts: one at a time
    s.schedule()
    assert s.took == [1000] and len(s.waiting) == 1
    s.running, s.took = [], []
    s.waiting = _Queue(_Waiting(64), _Waiting(10), _Waiting(8), _Waiting(900))
    s.schedule()  # the short ones ride along (at most MIN_CHUNK before the cost is learned)
    assert s.took == [64, 10, 8] and len(s.waiting) == 1
    assert isinstance(s.waiting, _Queue)  # the step's view is gone once it is scheduled


def test_prompts_ride_along_while_they_cost_less_than_a_steps_fixed_cost():
    cost = StepCost(2000)
    assert cost.rides_along(MIN_CHUNK) and not cost.rides_along(MIN_CHUNK + 1)
    cost.observe(15, 0, 0)  # fixed 15 ms
    cost.observe(15 + 256 * 0.5, 256, 0)  # 0.5 ms a token
    assert cost.rides_along(30) and not cost.rides_along(31)


@pytest.fixture(scope="module")
def vllm_scheduler(model_dir):
    """vLLM's own `Scheduler` over the tiny model (no engine: the scheduler alone, with a
    1,024-token budget, chunked prefill and prefix caching), as a class to install on."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    cache = CacheConfig(block_size=16, enable_prefix_caching=True)
    cache.num_gpu_blocks = 1000
    config = VllmConfig(
        model_config=ModelConfig(model=model_dir, dtype="float32", max_model_len=2048),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=16,
                                         max_model_len=2048, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=cache)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=1000, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)

    def make(cls):
        return cls(config, kv, StructuredOutputManager(config), block_size=16)

    def request(name: str, first: int, tokens: int):
        return Request(name, list(range(first, first + tokens)), SamplingParams(max_tokens=4),
                       None, block_hasher=hasher)

    return Scheduler, make, request


def test_vllms_scheduler_with_the_budget_finishes_a_prompt_before_packing_the_next(
        vllm_scheduler):
    """On vLLM's own scheduler (its queues, its loops): without the budget, the step that
    finishes a prompt is filled with the next one's chunk; with it, that step carries the
    finishing prompt alone, and a fresh prompt admitted whole is followed by a short one only."""
    Scheduler, make, request = vllm_scheduler

    def steps(cls) -> list[dict[str, int]]:
        s = make(cls)
        s.add_request(request("a", 1, 1100))
        first = s.schedule().num_scheduled_tokens  # 1,024 of its 1,100
        for r in (request("b", 2001, 900), request("c", 3001, 10)):
            s.add_request(r)
        second = s.schedule().num_scheduled_tokens
        fresh = make(cls)
        for r in (request("d", 4001, 200), request("f", 6001, 12), request("e", 5001, 700)):
            fresh.add_request(r)
        return [first, second, fresh.schedule().num_scheduled_tokens]

    assert steps(Scheduler) == [{"a": 1024}, {"a": 76, "b": 900, "c": 10},
                                {"d": 200, "f": 12, "e": 700}]
    cls = type("Budgeted", (Scheduler,), {})
    install(2000, 256, cls)
    assert steps(cls) == [{"a": 1024}, {"a": 76}, {"d": 200, "f": 12}]
    packing = type("Packing", (Scheduler,), {})
    install(2000, 256, packing, finish=False)  # make bench-burst's baseline: vLLM's packing
    assert steps(packing) == steps(Scheduler)


def test_an_engine_without_a_step_budget_finishes_its_prompts_first(vllm_scheduler):
    """A CPU prefill engine (no streams, no step budget): its steps keep vLLM's budget, but the
    one that finishes a prompt carries no other's chunk; a budgeted engine's install wins."""
    Scheduler, make, request = vllm_scheduler
    cls = type("Prefill", (Scheduler,), {})
    install_finish_first(cls)
    install_finish_first(cls)  # idempotent
    s = make(cls)
    s.add_request(request("a", 1, 1100))
    s.add_request(request("b", 2001, 900))
    assert s.schedule().num_scheduled_tokens == {"a": 1024}
    assert s.schedule().num_scheduled_tokens == {"a": 76}
    assert s.max_num_scheduled_tokens == 1024  # the cap held for that step only
    assert s.schedule().num_scheduled_tokens == {"b": 900}
    budgeted = type("Budgeted", (Scheduler,), {})
    install(2000, 256, budgeted)
    wrapped = budgeted.schedule
    install_finish_first(budgeted)
    assert budgeted.schedule is wrapped
