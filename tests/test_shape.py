"""The embedded cluster's shape for a machine (`cluster.shape.choose`)."""

import pytest

from cluster.shape import choose


def test_two_cores_keep_one_for_serving_and_bind_one_engine_to_the_other():
    s = choose([0, 1])
    assert [(e.role, e.cpu_bind, e.threads) for e in s.engines] == [("both", "1", 1)]
    assert "1 for the serving processes" in s.reason
    assert not s.engines[0].busy_wait
    assert s.serving_cpus == "0"  # the serving processes are started there


def test_many_cores_give_each_engine_its_own_cores():
    s = choose(list(range(17)))
    assert [(e.cpu_bind, e.threads) for e in s.engines] == [("1-8", 8), ("9-16", 8)]


def test_gpus_get_one_engine_each_that_may_busy_wait():
    s = choose(list(range(8)), gpus=2)
    assert [(e.role, e.gpu, e.busy_wait) for e in s.engines] == [("both", "0", True),
                                                                 ("both", "1", True)]


def test_an_explicit_shape_overrides_and_shares_out_the_cores():
    s = choose([0, 1], prefill=1, decode=1)
    assert [(e.role, e.cpu_bind) for e in s.engines] == [("prefill", "0"), ("decode", "1")]
    crowded = choose([0, 1], prefill=2, decode=2)
    assert {e.cpu_bind for e in crowded.engines} == {"nobind"}
    assert "share them" in crowded.reason


def test_a_prefill_engine_on_the_serving_cores_computes_in_the_background():
    pd = choose([0, 1], prefill=1, decode=1)
    assert [(e.role, e.background) for e in pd.engines] == [("prefill", True),
                                                            ("decode", False)]
    assert "background" in pd.describe()
    assert pd.serving_cpus == "0"  # with the background prefill, not the decode's core
    spare = choose([0, 1, 2], prefill=1, decode=1)  # core 0 kept for the serving processes
    assert [(e.cpu_bind, e.background) for e in spare.engines] == [("1", False), ("2", False)]
    assert spare.serving_cpus == "0"
    crowded = choose([0, 1], prefill=2, decode=2)
    assert not any(e.background for e in crowded.engines) and crowded.serving_cpus == ""
    both = choose([0, 1], both=2)  # every core computes: the serving processes float
    assert not any(e.background for e in both.engines) and both.serving_cpus == ""
    assert choose(list(range(8)), gpus=2).serving_cpus == ""


@pytest.mark.parametrize("counts", [dict(prefill=1), dict(decode=2), dict(both=0)])
def test_a_shape_that_cannot_serve_is_refused(counts):
    with pytest.raises(ValueError):
        choose([0, 1], **counts)
