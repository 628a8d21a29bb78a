"""The embedded cluster's shape: how many engines in which roles, and which cores each computes
on, for the machine it runs on (`choose`), or as the operator asked.

Engines that share cores time-slice them, so a prefill on one stalls the streams of the
other, and one engine with every core serves a tiny model's requests faster than two with one
core each (docs/design.md, "Where the processes run on a CPU", has the figures). So:

- GPUs: one engine per GPU, each in the `both` role; the conductor's policy disaggregates a
  request (prefill on one, decode on another) where its models say that pays.
- CPU: one core left to the serving processes (the conductor, each worker's front end:
  gRPC, detokenizing; etcd, the store master), as vLLM's CPU guide advises for its own front
  end: an engine's OpenMP threads meet at a barrier every step, so one thread preempted by a
  front end stalls the whole step. Then one `both` engine per `CORES_PER_ENGINE` of the other
  cores (at least one), each bound to cores of its own, so that engines never fight either.
  On a machine of up to `SIDE_ENGINE_MAX_CORES` cores, a side engine on the serving cores as
  well, at normal priority, its steps beside streams held to the same time: under an open
  load of long prompts one engine on one core of two queues them all, and the conductor
  prices the side engine's tokens a TBT slower each (`SchedulerParams.side_cost`), so it gets
  the prompts the other's queue would hold longer and short answers, the lone long stream the
  engine with a core of its own. The conductor
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
a second engine only pays once the first has cores it cannot use well (chosen on 2 cores,
not measured beyond; override with --both N)."""
STEP_TOKENS_PER_THREAD = 256
"""Prompt tokens a CPU engine that decodes computes per step and OpenMP thread at no context
beside streams until it has timed a step of its own (`Engine.step_tokens`,
`Engine.step_context`); from then on `step_target_ms` sets it."""
STEP_CONTEXT_TOKENS = 2000
"""The context at which a CPU engine's step budget is halved (`worker.step_budget`): about
where a prompt token costs twice one at none (the benchmark model in bfloat16 on one core)."""
STEP_SLO_SHARE = 0.5
"""How long a step that carries streams' tokens may take with a prompt chunk beside them, as a
share of the conductor's TBT SLO (`step_target_ms`; the engine learns what that buys in tokens
from its own steps, `worker.step_budget`): half, so that a stream's gaps stay within the SLO
with the decode-only steps between. `STEP_TOKENS_PER_THREAD` is about such a step at a
prompt's start on a CPU with AMX for the TBT SLO of `make bench-e2e` (100 ms at the 90th
percentile of a request's gaps)."""


def step_target_ms(tbt_slo_s: float) -> float:
    """The step target of the engines of a conductor whose default TBT SLO is `tbt_slo_s`.
    Engine-wide: a request that asks for a stricter TBT SLO of its own is not held to it."""
    return STEP_SLO_SHARE * tbt_slo_s * 1e3


SIDE_ENGINE_MAX_CORES = 4
"""Up to this many cores the chosen shape adds a side engine on the serving cores: there
they are a large share of the machine's compute (half of it on 2 cores), left idle by the
serving processes most of the time. Chosen on 2 cores only (docs/design.md, "A side engine
on the serving core, up to 4 cores"); on more cores the
serving core is a small share and the serving processes' own load grows with the engines."""
SIDE_STEP_TOKENS_PER_THREAD = 128
"""The side engine's step budget until it has timed a step (`STEP_TOKENS_PER_THREAD`): half the
others', since it computes between the serving processes' turns on its core; it shrinks with
the context as theirs does (`STEP_CONTEXT_TOKENS`)."""


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
    the conductor and the worker front ends and holds first tokens back on their way out; a
    10 ms spin does not (docs/design.md, "The engine core among the serving processes")."""
    engine_core_cpus: str = ""
    """Where its engine-core process (vLLM's scheduler) runs, when not beside its model worker
    on `cpu_bind`: the serving cores, for an engine whose cores are its own. Its model
    worker's compute thread then has its core alone and busy-waits for the next step as vLLM
    does (1 s), while the engine core, among the serving processes, waits 10 ms at most. The
    two together, not either alone, bring its decode steps near those of a plain `vllm serve`,
    which places its processes the same way: beside its model worker, the engine core's
    spinning takes turns with the compute on one core (docs/design.md, "The engine core among
    the serving processes")."""
    background: bool = False
    """Whether its vLLM processes (engine core, model worker; not its front end) run at
    `SCHED_IDLE` (`worker/vllm_plugin.py`): set for prefill engines on cores the serving
    processes share. At the same priority a prefill (20-50 ms of compute) holds up the
    front ends and the conductor, and every token of the decode's streams waits; at
    `SCHED_IDLE` the kernel counts the core as idle for them. It pays with the serving
    processes placed on the prefill's core and the decode's engine processes on their own;
    with every process floating it changes nothing beyond the noise (docs/design.md,
    "Prefill engines sharing the serving core run at `SCHED_IDLE`")."""
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
    steps of the streams it shares the engine with: unchunked, vLLM's default budget holds
    every stream for the whole prefill of a long prompt (about a second for 2,048 tokens of
    the benchmark model on one core, ten times a 100 ms TBT SLO). Its price is one step more
    per chunk, each with its fixed cost. vLLM's `long_prefill_token_threshold` (the cap only
    while other requests share the engine) is no substitute: two long prompts then share each
    step, both prefilled at half speed, the step as long as before. A model ten times larger
    prefills ten times slower per token, and a CPU without AMX several times slower, so with a
    `step_context` this is only the budget until the engine has timed a step of its own, then
    what fits `step_target_ms`, fewer tokens as the context grows. Where no stream runs, a step
    takes vLLM's budget: fewer steps finish a lone prompt sooner. The figures are in
    docs/design.md, "Steps on a CPU engine"."""


@dataclass(frozen=True)
class Shape:
    engines: tuple[Engine, ...]
    reason: str
    serving_cpus: str = ""
    """The cores the serving processes (conductor, worker front ends, etcd, the store) are
    started on: those no engine computes on but a background one; "" = anywhere. Each bound
    engine's model worker stays on its own cores (the worker's `--engine-cpus`), its engine
    core on these (`Engine.engine_core_cpus`). Left to themselves, an engine-core process
    floats to whichever core is free and spins there, and the serving processes float onto
    the engines' cores, whose compute threads then wait for them and stretch every token gap
    (docs/design.md, "A core for the serving processes")."""

    conductor_cpus: str = ""
    """Where the conductor runs, when not on `serving_cpus`: the chosen shape with a side
    engine puts it on the main engine's cores. There the engine's compute thread busy-waits
    for its next step and yields the core (`sched_yield`) to whatever wakes on it, so the
    conductor finds it free while its request waits on the engine; on the serving core it
    queued behind the worker front ends, the engine cores and the side engine. There a
    request's added latency is a third of what it is on the serving core, its token gaps a
    little longer (its per-token work beside the engine's); chosen on 2 cores only
    (docs/design.md, "The conductor on the main engine's core"). "": `serving_cpus`."""

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
