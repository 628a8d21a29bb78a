"""The embedded cluster's shape: how many engines in which roles, and which cores each computes
on, for the machine it runs on (`choose`), or as the operator asked.

Measured on a 2-core machine (docs/benchmarks.md, `make bench-serve`): engines that share
cores time-slice them, so a prefill on one stalls the streams of the other, and one engine
with every core serves a tiny model's requests faster than two with one core each. So:

- GPUs: one engine per GPU, each in the `both` role; the conductor's policy disaggregates a
  request (prefill on one, decode on another) where its models say that pays.
- CPU: one core left to the serving processes (the conductor, each worker's front end:
  gRPC, detokenizing; etcd, the store master), as vLLM's CPU guide advises for its own front
  end: an engine's OpenMP threads meet at a barrier every step, so one thread preempted by a
  front end stalls the whole step (measured here: 5.4 ms per output token with the engine on
  both cores, 4.4 ms on one). Then one `both` engine per `CORES_PER_ENGINE` of the other
  cores (at least one), each bound to cores of its own, so that engines never fight either.
  On a machine of up to `SIDE_ENGINE_MAX_CORES` cores, a side engine on the serving cores as
  well, at normal priority, its steps beside streams held to the same time: under an open
  load of long prompts one engine on one core of two queues them all (`make bench-e2e`'s
  trace: TTFT p50 3 s), and the conductor prices the side engine's tokens a TBT slower each
  (`SchedulerParams.side_cost`), so it gets the prompts the other's queue would hold longer
  and short answers, the lone long stream the engine with a core of its own. The conductor
  then runs on the main engine's core, which its compute thread yields while it waits for a
  step (`Shape.conductor_cpus`).

An explicit shape (`--prefill N --decode N --both N`) gets the cores shared out the same way
(the serving core kept while there are more cores than engines); engines outnumbering the
cores share them unbound, one thread each. Where no core is left for the serving processes
(Mooncake's shape on 2 cores: prefill on core 0, decode on core 1), prefill engines compute
in the background (`Engine.background`): the serving processes, which carry every token of
the decode's streams, take a prefill's core whenever they need it. CPU engines that decode
prefill in chunks (`Engine.step_tokens`), so that a long prompt does not hold their streams
for a whole prefill.

Placed engines keep all their processes on their own cores, and the serving processes are
started on the rest (`Shape.serving_cpus`), so that nothing floats onto a core where an
engine computes: the conductor alone is placed with an engine, by the chosen shape with a side
engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from cluster.instance import cpu_list, format_cpu_list

SPIN_ENV = "KVCLUSTER_ENGINE_SPIN_S"
"""How long an engine's vLLM processes busy-wait for the next message (`Engine.busy_wait`)."""
WORKER_SPIN_ENV = "KVCLUSTER_WORKER_SPIN_S"
"""Set: how long its model-worker process busy-waits instead (`Engine.engine_core_cpus`)."""
BACKGROUND_ENV = "KVCLUSTER_ENGINE_BACKGROUND"
"""Set: the engine runs at SCHED_IDLE (`Engine.background`). Both are read in every vLLM
process of the engine by `worker/vllm_plugin.py`."""
STEP_CONTEXT_ENV = "KVCLUSTER_STEP_CONTEXT_TOKENS"
"""`Engine.step_context`, read by the engine core (`worker.step_budget`)."""
STEP_TOKENS_ENV = "KVCLUSTER_STEP_TOKENS"
"""`Engine.step_tokens` of an engine with a `step_context`, read by the engine core (its vLLM
budget, a step's with no stream to hold up, is then vLLM's, or this one where it is larger:
`cluster.workers.VLLM_STEP_TOKENS`)."""
STEP_MS_ENV = "KVCLUSTER_STEP_MS"
"""`step_target_ms` of the conductor's TBT SLO, for every engine with a `step_context`
(`worker.step_budget`)."""

RESERVED_CORES = 1
"""Cores kept for the serving processes when there is more than one."""
CORES_PER_ENGINE = 8
"""CPU cores per engine when the shape is chosen: fewer engines with more threads each, since
a second engine only pays once the first has cores it cannot use well (not measured beyond
this machine's 2 cores; override with --both N)."""
STEP_TOKENS_PER_THREAD = 256
"""Prompt tokens a CPU engine that decodes computes per step and OpenMP thread at no context
beside streams until it has timed a step of its own (`Engine.step_tokens`,
`Engine.step_context`); from then on `step_target_ms` sets it."""
STEP_CONTEXT_TOKENS = 2000
"""The context at which a CPU engine's step budget is halved (`worker.step_budget`): measured
1,940 for the bench-e2e model in bfloat16 on one core (a token there costs twice one at none)."""
STEP_SLO_SHARE = 0.5
"""How long a step that carries streams' tokens may take with a prompt chunk beside them, as a
share of the conductor's TBT SLO (`step_target_ms`; the engine learns what that buys in tokens
from its own steps, `worker.step_budget`): half, so that a stream's gaps stay within the SLO
with the decode-only steps between. On the AMX Xeon of 2026-11-26 a 256-token step at a
prompt's start took 45-49 ms (`STEP_TOKENS_PER_THREAD`): half of bench-e2e's TBT SLO (100 ms at
the 90th percentile of a request's gaps)."""


def step_target_ms(tbt_slo_s: float) -> float:
    """The step target of the engines of a conductor whose default TBT SLO is `tbt_slo_s`.
    Engine-wide: a request that asks for a stricter TBT SLO of its own is not held to it."""
    return STEP_SLO_SHARE * tbt_slo_s * 1e3


SIDE_ENGINE_MAX_CORES = 4
"""Up to this many cores the chosen shape adds a side engine on the serving cores: there
they are a large share of the machine's compute (half of it on 2 cores), left idle by the
serving processes most of the time. Measured on 2 cores only (`make bench-e2e`, trace
workload, goodput over vllm-router P/D's: 0.63 without it in run 3, 1.28 with it; `make
bench-serve` unchanged, the side engine decoding 0-3 of 128 requests); on more cores the
serving core is a small share and the serving processes' own load grows with the engines."""
SIDE_STEP_TOKENS_PER_THREAD = 128
"""The side engine's step budget until it has timed a step (`STEP_TOKENS_PER_THREAD`): half the
others', since it computes between the serving processes' turns on its core (in float32,
with 128 its streams' p90 token gap passed 100 ms under the trace workload's long prompts: 5
of 48 requests; with 64, none of its own; in bfloat16 128, with the budget shrinking as the
context grows, `STEP_CONTEXT_TOKENS`)."""


@dataclass(frozen=True)
class Engine:
    role: str
    cpu_bind: str
    """`VLLM_CPU_OMP_THREADS_BIND`: a CPU list of its own, or "nobind"."""
    threads: int
    """`OMP_NUM_THREADS`."""
    gpu: str = ""
    """`CUDA_VISIBLE_DEVICES`, on a GPU machine."""
    busy_wait: bool = False
    """Whether its vLLM processes may busy-wait between steps as vLLM does (1 s): only on a
    GPU. On CPU only the engine's OpenMP threads are bound; its engine-core process floats
    over every core, the serving core too, where a second of spinning after each step starves
    the conductor and the worker front ends (measured with `make bench-serve`: 10-19 of 60
    first tokens held 100-930 ms on their way to the conductor; none with a 10 ms spin)."""
    engine_core_cpus: str = ""
    """Where its engine-core process (vLLM's scheduler) runs, when not beside its model worker
    on `cpu_bind`: the serving cores, for an engine whose cores are its own. Its model
    worker's compute thread then has its core alone and busy-waits for the next step as vLLM
    does (1 s), while the engine core, among the serving processes, waits 10 ms at most. The
    two together, not either alone: measured with the step times of the engine core
    (`make bench-serve`'s prefix dataset, `auto`, one run each, decode steps of one request,
    median): both processes on the engine's core 3.6-4.0 ms (the engine core's spinning
    takes turns with the compute on one core; the worker spinning too: 3.9), the engine core
    on the serving core alone 4.0, both changes 2.7-2.9; a plain `vllm serve`, which places
    its processes the same way, 2.4."""
    background: bool = False
    """Whether its vLLM processes (engine core, model worker; not its front end) run at
    `SCHED_IDLE` (`worker/vllm_plugin.py`): set for prefill engines on cores the serving
    processes share. At the same priority a prefill (20-50 ms of compute) holds up the
    front ends and the conductor, and every token of the decode's streams waits; at
    `SCHED_IDLE` the kernel counts the core as idle for them. Measured with `make
    bench-serve`, pd arm, with the serving processes on the prefill's core and the decode's
    engine processes on its own: TPOT 5.0-5.2 ms, TTFT 32-48 ms; the prefill at normal
    priority 5.9 and 39-52 (one run each). Alone (every process floating) it changed
    nothing beyond the noise."""
    side: bool = False
    """Whether it computes on the serving cores at normal priority (the chosen shape's side
    engine, `SIDE_ENGINE_MAX_CORES`): registered (`InstanceInfo.side`), so that the policy
    prices its streams' tokens slower and the serving processes' delay
    (`SchedulerParams.side_cost`, `snapshot.contention`)."""
    step_context: int = 0
    """With `step_tokens`: the context at which the budget is halved, each step's budget
    shrinking with the context its prompt chunk attends to (`worker.step_budget`; 0: fixed)."""
    step_tokens: int = 0
    """Tokens one step of it may compute while streams run on it (0: vLLM's 2048; with a
    `step_context` a step with no stream gets vLLM's where that is larger,
    `worker.step_budget`; without, every step gets this one, `--max-num-batched-tokens`): set
    for CPU engines that decode, so that a prompt is prefilled in chunks between the token
    steps of the streams it shares the engine with. One core prefills the benchmark model
    (25.7M parameters) at ~0.4 ms a token (`make bench-e2e`'s model; 128 tokens 53 ms, 2048
    in 940 ms, one step each; chunked by 256, 2% slower in all), so vLLM's default budget
    holds every stream ~1 s whenever a 2048-token prompt arrives, ten times a 100 ms TBT SLO;
    `STEP_TOKENS_PER_THREAD` keeps a chunk near half of that. Its price is one step more
    per chunk (a few ms each here): with `make bench-serve` (2026-11-26, 2 repetitions, the
    random dataset's 256-token prompts in two steps) TTFT p50 36.6-41.2 ms against 30.7-32.0
    without a budget (`--step-tokens 0`), 1.49x plain vLLM against 1.22x; bench-e2e's
    goodput on long prompts under load is what it buys (docs/benchmarks.md). vLLM's
    `long_prefill_token_threshold` (the cap only while other requests share the engine)
    with a budget of twice the chunk did not win it back (36 ms, 1.40x); nor, against the
    token gaps of the streams beside a long prompt (a 128-token chunk at a 2,000-token
    context takes ~90 ms), does it at half the budget: two prompts then share each step,
    both prefilled at half speed, the step as long as before (`make bench-e2e`, 2026-11-26
    09:40, shared_prefix gaps of 107-138 ms, trace goodput 0.87x vllm-router P/D's against
    1.13x without). Those figures are float32's; in bfloat16 (the engines' default since
    2026-11-26, `worker.dtype`) a 128-token step of that model takes 26-33 ms at a prompt's
    start and 54 ms at 3,400 tokens of context (62 and 142 in float32, one core, compiled),
    a 256-token one 45-49 ms at the start: so 256 a thread since, shrinking with the context
    (`step_context`). Measured with `make bench-e2e`'s arms 1 and 2 (2 repetitions against
    run 6's 3, 2026-11-26 13:52): arm 1's TTFT p99 1.04-1.21 s on shared_prefix against
    1.36-2.41, 1.51-1.68 on the trace against 1.54-2.67, 0.30-0.54 on low_reuse against
    0.58-0.96, TBT p99 43-50 ms against 51-82, every request served within its SLOs. A model
    ten times larger prefills ten times slower per token, and a CPU without AMX several times
    slower: since 2026-11-26 22:54 this is only the budget until the engine has timed a step
    of its own, then what fits `step_target_ms` (on the AMD EPYC the project moved to that
    day, steps beside streams took 80-118 ms on average: in bench-e2e, 1 of 24 shared_prefix
    requests and 1-4 of 24 of the trace's missed the TBT SLO in each of 3 repetitions; in
    time none did, but 2-3 of the trace's missed the TTFT SLO instead, their prompts computed
    in smaller chunks: docs/benchmarks.md, "After run 8"). Where no stream runs, a step
    takes vLLM's budget (a cold 2,252-token prompt in 265 + 66 ms on one core against 662 ms
    in the streams' steps; `make bench-e2e` A/B of 2026-11-26 19:54: arm 1's TTFT p99 0.63 s
    against 1.15 on shared_prefix, 0.80 against 1.60 on the trace, token gaps shorter)."""


@dataclass(frozen=True)
class Shape:
    engines: tuple[Engine, ...]
    reason: str
    serving_cpus: str = ""
    """The cores the serving processes (conductor, worker front ends, etcd, the store) are
    started on: those no engine computes on but a background one; "" = anywhere. Each bound
    engine's model worker stays on its own cores (the worker's `--engine-cpus`), its engine
    core on these (`Engine.engine_core_cpus`). Left to themselves, an engine-core process
    floated to whichever core was free and spun there, and the serving processes floated
    onto the engines' cores: measured with `make bench-serve`, pd arm, the decode engine's
    compute thread waited for its core 10.6% of the time (2.7% alone there, 10% beside its
    own engine core, which yields to it); later token gaps 5.5-5.7 ms, 3.9-4.3 (3
    repetitions each)."""

    conductor_cpus: str = ""
    """Where the conductor runs, when not on `serving_cpus`: the chosen shape with a side
    engine puts it on the main engine's cores. There the engine's compute thread busy-waits
    for its next step and yields the core (`sched_yield`) to whatever wakes on it, so the
    conductor finds it free while its request waits on the engine; on the serving core it
    queued behind the worker front ends, the engine cores and the side engine. Measured on
    2 cores only (`benchmarks/e2e/overhead.py`, the added latency of a 1-token request,
    medians of 40 pairs, alternating on one start): 0.83-0.96 ms there (one round 2.66)
    against 2.75-3.64 on the serving core. Under `make bench-e2e`'s load (docs/benchmarks.md,
    session 25) token gaps and goodput unchanged beyond the spread; under `make
    bench-serve`'s 4 requests/s, first tokens 1.7-5 ms sooner and token gaps 0.1-0.5 ms
    longer (its per-token work now beside the engine's), one run each. "": `serving_cpus`."""

    @property
    def conductor_home(self) -> str:
        """The cores the conductor is started on: `conductor_cpus`, else `serving_cpus` ("":
        wherever its starter runs)."""
        return self.conductor_cpus or self.serving_cpus

    def count(self, role: str) -> int:
        return sum(e.role == role for e in self.engines)

    def describe(self) -> str:
        parts = [f"{self.count(r)} {r}" for r in ("prefill", "decode", "both") if self.count(r)]
        places = ", ".join(f"{e.role}: {'gpu ' + e.gpu if e.gpu else 'cores ' + e.cpu_bind}"
                           f" x{e.threads}{' background' if e.background else ''}"
                           + (f" (scheduler on {e.engine_core_cpus})" if e.engine_core_cpus
                              else "")
                           + (f" {e.step_tokens}-token steps" if e.step_tokens else "")
                           + (" beside streams" if e.step_tokens and e.step_context else "")
                           + (" beside the serving processes" if e.side else "")
                           for e in self.engines)
        serving = f"; serving processes on cores {self.serving_cpus}" if self.serving_cpus else ""
        if self.conductor_cpus:
            serving += f", the conductor on cores {self.conductor_cpus}"
        return f"{' + '.join(parts)} ({places}{serving}): {self.reason}"


def machine_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return list(range(os.cpu_count() or 1))


def choose(cores: list[int], gpus: int = 0, prefill: int | None = None,
           decode: int | None = None, both: int | None = None,
           step_tokens: int | None = None) -> Shape:
    """The shape for these cores and GPUs; counts given (any of them) override the choice,
    and `step_tokens` the CPU engines' step budget (0: vLLM's default)."""
    s = _choose(cores, gpus, prefill, decode, both)
    if step_tokens is None:
        return s
    if 0 < step_tokens < 32:
        raise ValueError(f"step_tokens: 0 (vLLM's default) or at least 32, got {step_tokens}")
    return replace(s, engines=tuple(replace(e, step_tokens=step_tokens if e.step_tokens else 0)
                                    for e in s.engines))


def _choose(cores: list[int], gpus: int, prefill: int | None, decode: int | None,
            both: int | None) -> Shape:
    if prefill is not None or decode is not None or both is not None:
        roles = ["prefill"] * (prefill or 0) + ["decode"] * (decode or 0) + ["both"] * (both or 0)
        if not roles:
            raise ValueError("a cluster needs at least one engine")
        if not any(r != "prefill" for r in roles) or not any(r != "decode" for r in roles):
            raise ValueError("a cluster needs a prefill-capable and a decode-capable engine")
        return _place(roles, _engine_cores(cores, len(roles)), gpus, "as asked", cores)
    if gpus:
        return _place(["both"] * gpus, cores, gpus,
                      f"{gpus} GPU(s): one engine each, the policy disaggregates where it pays")
    usable = _engine_cores(cores, 1)
    n = max(1, len(usable) // CORES_PER_ENGINE)
    kept = f"{len(cores) - len(usable)} for the serving processes, " if len(usable) < len(
        cores) else ""
    why = (f"{len(cores)} cores: {kept}one engine on the rest" if n == 1 else
           f"{len(cores)} cores: {kept}{n} engines of {len(usable) // n} cores each")
    placed = _place(["both"] * n, usable, 0, why, cores)
    serving = set(cores) - set(usable)
    if not serving or len(cores) > SIDE_ENGINE_MAX_CORES:
        return placed
    side = Engine("both", format_cpu_list(serving), len(serving), side=True,
                  step_tokens=SIDE_STEP_TOKENS_PER_THREAD * len(serving),
                  step_context=STEP_CONTEXT_TOKENS)
    return replace(placed, engines=(*placed.engines, side),
                   conductor_cpus=placed.engines[0].cpu_bind,
                   reason=placed.reason + "; and a side one on the serving cores, where the "
                   "policy sends what the other's queue would hold longer")


def _engine_cores(cores: list[int], engines: int) -> list[int]:
    """The cores engines compute on: all but the serving ones, while that leaves each one."""
    if len(cores) - RESERVED_CORES >= engines:
        return cores[RESERVED_CORES:]
    return cores


def _place(roles: list[str], cores: list[int], gpus: int, reason: str,
           machine: list[int] | None = None) -> Shape:
    """`cores`: the engines'; `machine`: every core (the serving processes' are the rest)."""
    if gpus:
        return Shape(tuple(Engine(r, "nobind", 1, gpu=str(i % gpus), busy_wait=True)
                           for i, r in enumerate(roles)), reason)
    n = len(roles)
    if n > len(cores):  # more engines than cores: unbound, one thread each
        return Shape(tuple(Engine(r, "nobind", 1, step_tokens=_step_tokens(r, 1),
                                  step_context=_step_context(r)) for r in roles),
                     reason + f"; {n} engines on {len(cores)} cores share them")
    per = len(cores) // n
    machine = machine or cores
    background = len(cores) == len(machine) and "prefill" in roles
    if background:
        reason += "; prefill engines in the background of the serving processes"
    engines = [Engine(r, format_cpu_list(set(cores[i * per:(i + 1) * per])), per,
                      background=background and r == "prefill",
                      step_tokens=_step_tokens(r, per), step_context=_step_context(r))
               for i, r in enumerate(roles)]
    computing = set().union(*(cpu_list(e.cpu_bind) for e in engines if not e.background))
    serving = format_cpu_list(set(machine) - computing)
    if serving:  # the engines' cores are their own: their schedulers join the serving cores
        engines = [e if e.background else replace(e, engine_core_cpus=serving)
                   for e in engines]
    return Shape(tuple(engines), reason, serving)


def _step_context(role: str) -> int:
    return 0 if role == "prefill" else STEP_CONTEXT_TOKENS


def _step_tokens(role: str, threads: int) -> int:
    """A CPU engine's step budget (`Engine.step_tokens`); prefill engines, with no streams to
    hold up, keep vLLM's larger one."""
    return 0 if role == "prefill" else STEP_TOKENS_PER_THREAD * threads
