"""What a ResizePool does (`conductor.resize.plan`) for every role, with workers still
starting counted, and what the machine can hold (`cluster.capacity`): pure functions."""

from __future__ import annotations

import pytest

from cluster.capacity import ENGINES_PER_CORE, RESERVE_BYTES, Capacity, Machine, engine_bytes
from cluster.workers import WorkerSpec
from conductor.resize import Member, ResizePlan, Starting, plan

GiB = 1 << 30


def member(iid: str, role: str, registered: str | None = None, routable: bool = True,
           **kw) -> Member:
    return Member(iid, role, registered or role, routable, **kw)


def test_both_grows_by_undraining_then_switching_then_starting():
    members = [member("both-0", "both"),
               member("both-1", "both", routable=False, draining=True),
               member("both-2", "decode", "both"),
               member("prefill-0", "prefill")]
    p = plan("both", 5, members, [], can_start=True)
    assert p == ResizePlan("both", 5, before=1, undrain=("both-1",),
                           switch=(("both-2", "both"),), start=2)
    # a deployed cluster: the rest is said to be missing
    assert plan("both", 5, members, [], can_start=False).short == 2


def test_prefill_and_decode_count_both_instances_and_switch_them_out():
    members = [member("both-0", "both"), member("decode-0", "decode")]
    assert plan("prefill", 1, members, [], True) == ResizePlan("prefill", 1, before=1)
    p = plan("decode", 1, members, [], True)  # both-0 and decode-0 serve decode
    assert p.before == 2 and p.switch == (("both-0", "prefill"),) and not p.drain
    p = plan("prefill", 0, members, [], True)  # decode-0 serves decode: both-0 switches
    assert p.switch == (("both-0", "decode"),)
    p = plan("prefill", 0, [member("both-0", "both")], [], True)  # alone: it switches anyway
    assert p.switch == (("both-0", "decode"),)


def test_both_shrinks_by_draining_started_here_then_side_then_least_loaded():
    members = [member("both-0", "both", in_flight=0),
               member("both-1", "both", side=True, in_flight=5),
               member("both-2", "both", in_flight=1),
               member("both-s0", "both", started_here=True, in_flight=9)]
    p = plan("both", 1, members, [], True)
    assert p.drain == ("both-s0", "both-1", "both-0") and not p.switch


def test_workers_still_starting_count_so_a_repeated_call_starts_nothing_more():
    members = [member("both-0", "both")]
    first = plan("both", 2, members, [], True)
    assert first.start == 1
    again = plan("both", 2, members, [Starting("both-s0", "both")], True)
    assert again == ResizePlan("both", 2, before=1, starting=("both-s0",))
    # a "both" worker starting serves prefill and decode too
    assert plan("decode", 2, members, [Starting("both-s0", "both")], True).start == 0
    assert plan("both", 2, members, [Starting("decode-s0", "decode")], True).start == 1


def test_shrinking_cancels_workers_still_starting_first_the_newest_first():
    members = [member("both-0", "both")]
    starting = [Starting("both-s0", "both"), Starting("both-s1", "both")]
    p = plan("both", 2, members, starting, True)
    assert (p.cancel, p.starting, p.drain) == (("both-s1",), ("both-s0",), ())
    p = plan("both", 0, members, starting, True)
    assert (p.cancel, p.starting, p.drain) == (("both-s1", "both-s0"), (), ("both-0",))


def test_an_unknown_role_or_a_negative_target_is_refused():
    with pytest.raises(ValueError, match="prefill, decode, both"):
        plan("router", 1, [], [], True)
    with pytest.raises(ValueError, match=">= 0"):
        plan("both", -1, [], [], True)


def test_capacity_counts_engines_per_core_or_the_cap_and_memory_for_those_loading():
    machine = Machine(cores=2, available_bytes=RESERVE_BYTES + 10 * GiB)
    c = Capacity(engine_bytes=3 * GiB)
    cap = ENGINES_PER_CORE * 2
    assert c.refusal(machine, engines=cap - 1, starting=0, new=1) == ""
    assert "at most 4 engines" in c.refusal(machine, engines=cap - 1, starting=0, new=2)
    assert "at most 6 engines (--max-engines)" in Capacity(3 * GiB, 6).refusal(
        machine, engines=6, starting=0, new=1)
    assert Capacity(3 * GiB, 6).refusal(machine, engines=4, starting=0, new=2) == ""
    # memory: 3 GiB each for those loading and the new ones, 10 GiB to give
    assert c.refusal(machine, engines=1, starting=1, new=2) == ""
    why = c.refusal(machine, engines=1, starting=2, new=2)
    assert "not enough memory" in why and "3072 MiB each" in why


def test_an_engine_takes_its_kv_cache_weights_segment_and_runtime(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "config.json").write_text("{}")
    spec = WorkerSpec(model=str(tmp_path), etcd="", pool_master="", pool_metadata="",
                      run_dir="", kv_cache_bytes=1 << 20, pool_segment_bytes=1 << 21)
    shared = WorkerSpec(**{**spec.__dict__, "pool_store_client": "127.0.0.1:1"})
    assert engine_bytes(spec) - engine_bytes(shared) == 1 << 21
    assert engine_bytes(shared) - (1 << 20) - 1000 > 1 << 30  # the runtime's share
