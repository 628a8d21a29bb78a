"""The embedded cluster's shape for a machine (`cluster.shape.choose`)."""

import shutil

import pytest

from cluster.shape import (
    SIDE_STEP_TOKENS_PER_THREAD,
    STEP_CONTEXT_ENV,
    STEP_CONTEXT_TOKENS,
    STEP_MS_ENV,
    STEP_TOKENS_ENV,
    STEP_TOKENS_PER_THREAD,
    choose,
    step_target_ms,
)


def test_two_cores_keep_one_for_serving_bind_an_engine_to_the_other_and_a_side_one_there():
    s = choose([0, 1])
    assert [(e.role, e.cpu_bind, e.threads) for e in s.engines] == [("both", "1", 1),
                                                                    ("both", "0", 1)]
    assert "1 for the serving processes" in s.reason and "serving cores" in s.reason
    assert not any(e.busy_wait or e.background for e in s.engines)
    assert s.serving_cpus == "0"  # the serving processes are started there, beside the side one
    # but the conductor, on the main engine's core it yields
    assert s.conductor_cpus == s.conductor_home == "1"
    assert "the conductor on cores 1" in s.describe()


def test_the_side_engine_only_on_small_machines():
    assert [e.cpu_bind for e in choose([0, 1, 2, 3]).engines] == ["1-3", "0"]
    assert [e.cpu_bind for e in choose(list(range(5))).engines] == ["1-4"]
    assert choose(list(range(5))).conductor_cpus == ""  # with the other serving processes
    assert [e.cpu_bind for e in choose([0]).engines] == ["0"]  # no serving core to add one on


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
    assert pd.conductor_cpus == "" and pd.conductor_home == "0"  # the conductor too
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


def test_an_engine_with_cores_of_its_own_schedules_from_the_serving_cores():
    """Its model worker computes alone on its core; its engine core joins the serving ones."""
    assert [e.engine_core_cpus for e in choose([0, 1]).engines] == ["0", ""]  # side: beside it
    assert "both: cores 1 x1 (scheduler on 0)" in choose([0, 1]).describe()
    pd = choose([0, 1], prefill=1, decode=1)  # the background prefill keeps both on core 0
    assert [(e.role, e.engine_core_cpus) for e in pd.engines] == [("prefill", ""),
                                                                  ("decode", "0")]
    for s in (choose([0, 1], both=2), choose([0, 1], prefill=2, decode=2),
              choose(list(range(8)), gpus=2)):  # no serving core, or nothing bound
        assert all(e.engine_core_cpus == "" for e in s.engines)


@pytest.fixture
def started(monkeypatch) -> list[tuple[list[str], dict[str, str]]]:
    """The (argv, env) of every worker process `cluster.workers` starts, none of them run."""
    import cluster.workers as workers

    recorded: list[tuple[list[str], dict[str, str]]] = []

    class Recorder:
        def __init__(self, name, argv, log, env, scratch=None):
            recorded.append((argv, env))
            if scratch:  # nothing runs to use it
                shutil.rmtree(scratch)

        def start(self):
            return self

    monkeypatch.setattr(workers, "ManagedProcess", Recorder)
    return recorded


def test_the_worker_is_started_with_its_engine_core_placed_and_its_worker_spinning(
        tmp_path, started):
    import cluster.workers as workers
    from cluster.shape import SPIN_ENV, WORKER_SPIN_ENV

    spec = workers.WorkerSpec(model="m", etcd="e", pool_master="p", pool_metadata="u",
                              run_dir=str(tmp_path), step_target_ms=37.5)
    for e in choose([0, 1], prefill=1, decode=1).engines:
        spec.start(e.role, e.role, port=1, placement=e)
    (prefill_argv, prefill_env), (decode_argv, decode_env) = started
    assert "--engine-core-cpus" not in prefill_argv and WORKER_SPIN_ENV not in prefill_env
    assert decode_argv[decode_argv.index("--engine-core-cpus") + 1] == "0"
    assert decode_argv[decode_argv.index("--engine-cpus") + 1] == "1"
    assert decode_env[WORKER_SPIN_ENV] == "1" and decode_env[SPIN_ENV] == "0.01"
    assert "--max-num-batched-tokens" not in prefill_argv + decode_argv  # vLLM's, alone
    assert decode_env[STEP_TOKENS_ENV] == str(STEP_TOKENS_PER_THREAD)  # until it has timed one
    assert decode_env[STEP_MS_ENV] == "37.5"  # beside streams, then
    assert decode_env[STEP_CONTEXT_ENV] == str(STEP_CONTEXT_TOKENS)  # a token's cost by context
    assert not {STEP_CONTEXT_ENV, STEP_TOKENS_ENV, STEP_MS_ENV} & set(prefill_env)
    started.clear()
    big = choose(list(range(33)), step_tokens=4096).engines[0]
    spec.start(big.role, big.role, port=1, placement=big)  # above vLLM's: every step's then
    ((big_argv, big_env),) = started
    assert big_argv[big_argv.index("--max-num-batched-tokens") + 1] == "4096"
    assert big_env[STEP_TOKENS_ENV] == "4096"
    started.clear()
    for e in choose([0, 1]).engines:  # the side engine announces itself
        spec.start(e.role, e.cpu_bind, port=1, placement=e)
    (home_argv, _), (side_argv, side_env) = started
    assert "--side" not in home_argv and side_argv[side_argv.index("--side") + 1] == "true"
    assert side_argv[side_argv.index("--engine-cpus") + 1] == "0"
    assert WORKER_SPIN_ENV not in side_env  # it spins no longer than the serving processes


def test_the_engines_step_target_is_half_the_tbt_slo_the_conductor_will_hold(
        model_dir, tmp_path, monkeypatch, capsys, started):
    """The launcher reads the SLO as the conductor will (its flags over its environment over
    its defaults) and hands each worker a share of it; without one a worker keeps its token
    budget alone."""
    from cluster import workers
    from conductor.config import ConductorConfig
    from embedded.launcher import ClusterSpec

    monkeypatch.delenv("KVCLUSTER_CONDUCTOR_TBT_SLO_S", raising=False)
    assert ClusterSpec(model=model_dir).step_target_ms == step_target_ms(
        ConductorConfig.tbt_slo_s)
    assert ClusterSpec(model=model_dir,
                       conductor_args=("--tbt-slo-s", "0.1")).step_target_ms == 50
    monkeypatch.setenv("KVCLUSTER_CONDUCTOR_TBT_SLO_S", "0.08")
    assert ClusterSpec(model=model_dir).step_target_ms == 40
    assert ClusterSpec(model=model_dir,
                       conductor_args=("--tbt-slo-s", "0.2")).step_target_ms == 100
    with pytest.raises(SystemExit):  # the conductor's own check, before anything starts
        ClusterSpec(model=model_dir, conductor_args=("--tbt-slo-s", "-1"))
    assert "tbt_slo_s" in capsys.readouterr().err

    spec = workers.WorkerSpec(model="m", etcd="e", pool_master="p", pool_metadata="u",
                              run_dir=str(tmp_path))
    home = choose([0, 1]).engines[0]
    spec.start(home.role, "both-0", port=1, placement=home)
    ((_, env),) = started
    assert STEP_CONTEXT_ENV in env and STEP_MS_ENV not in env


def test_cpu_engines_that_decode_prefill_in_chunks_of_a_budget_per_thread():
    """A long prompt cannot hold an engine's streams for a whole prefill (`step_tokens`)."""
    assert [e.step_tokens for e in choose([0, 1]).engines] == [STEP_TOKENS_PER_THREAD,
                                                               SIDE_STEP_TOKENS_PER_THREAD]
    assert f"{STEP_TOKENS_PER_THREAD}-token steps" in choose([0, 1]).describe()
    assert [e.step_tokens for e in choose(list(range(17))).engines] == \
        [8 * STEP_TOKENS_PER_THREAD] * 2
    pd = choose([0, 1], prefill=2, decode=2)  # prefill engines keep vLLM's budget
    assert [(e.role, e.step_tokens) for e in pd.engines] == \
        [("prefill", 0)] * 2 + [("decode", STEP_TOKENS_PER_THREAD)] * 2
    assert {e.step_tokens for e in choose(list(range(8)), gpus=2).engines} == {0}
    assert [e.step_tokens for e in choose([0, 1], step_tokens=512).engines] == [512, 512]
    assert [e.step_tokens for e in choose([0, 1], step_tokens=0).engines] == [0, 0]
    assert [e.step_tokens for e in choose([0, 1], 0, 1, 1, None, 64).engines] == [0, 64]
    with pytest.raises(ValueError):
        choose([0, 1], step_tokens=16)


@pytest.mark.parametrize("flag", ["--engine-cpus", "--engine-core-cpus"])
def test_a_worker_refuses_cores_the_machine_lacks(model_dir, flag, capsys):
    from worker.config import parse_args

    base = _worker_args(model_dir)
    assert getattr(parse_args([*base, flag, "0"], "decode"), flag[2:].replace("-", "_")) == "0"
    with pytest.raises(SystemExit):
        parse_args([*base, flag, "4096"], "decode")
    assert "no such cores here: '4096'" in capsys.readouterr().err


def test_a_worker_refuses_a_step_budget_below_a_block(model_dir, capsys):
    from worker.config import parse_args

    base = _worker_args(model_dir)
    assert parse_args([*base, "--max-num-batched-tokens", "128"], "decode") \
        .max_num_batched_tokens == 128
    with pytest.raises(SystemExit):
        parse_args([*base, "--max-num-batched-tokens", "16"], "decode")
    assert "at least block_size (32), got 16" in capsys.readouterr().err


def _worker_args(model_dir: str) -> list[str]:
    """The flags a worker cannot start without (nothing is reached: only parsed)."""
    return ["--model", model_dir, "--etcd", "127.0.0.1:1", "--pool-master", "127.0.0.1:1",
            "--pool-metadata", "http://127.0.0.1:1/metadata"]
