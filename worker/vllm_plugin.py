"""A vLLM general plugin (entry point `vllm.general_plugins`): loaded by every vLLM process,
it changes nothing unless the process belongs to one of our workers that was asked to.

`KVCLUSTER_ENGINE_SPIN_S`: how long vLLM's shared-memory message queue readers (the engine
core waiting for its worker process, the worker process waiting for the next step) busy-loop
after a message before they sleep on a socket (vLLM: 1 s). Each step of an engine refreshes
it, and an engine waiting for a pool load or a background save steps every millisecond, so
its two processes spin for as long as it serves. On cores of their own that costs nothing;
but on CPU only the engine's OpenMP threads are bound, and the engine-core process spins on
whatever core it lands on, the serving processes' too (measured: two engines on two cores,
each worker process at 90% of a core, the conductor's health checks and etcd timing out; one
engine bound to its own core, first tokens held up to 930 ms on their way to the conductor).
The launcher sets it to 0.01 s for every CPU engine (`cluster.shape.Engine.busy_wait`; 0 hung
the engine at start).
"""

from __future__ import annotations

import os


def register() -> None:
    spin = os.environ.get("KVCLUSTER_ENGINE_SPIN_S", "")
    if not spin:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    cls = shm_broadcast.SpinCondition
    if getattr(cls, "_kvcluster_spin", None) is not None:
        return
    original = cls.__init__
    seconds = float(spin)

    def __init__(self, is_reader, context, notify_address, busy_loop_s: float = 1):
        original(self, is_reader, context, notify_address, busy_loop_s=seconds)

    cls.__init__ = __init__
    cls._kvcluster_spin = seconds
