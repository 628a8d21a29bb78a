"""How many engines this machine can hold (`Capacity.refusal`): what `ResizePool` checks, in
embedded mode, before it starts any worker.

Two limits. A count: every engine the conductor knows (all on this machine in embedded mode),
those still starting and the new ones, at most `max_engines` (the conductor's
`--max-engines`), by default `ENGINES_PER_CORE` per core. And memory: the engines still
starting and the new ones each take `engine_bytes` (its KV cache, its weights, its own pool
segment where it has one, and `ENGINE_RUNTIME_BYTES`), which must fit in what the machine has
available now less `RESERVE_BYTES`; engines running already hold theirs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import psutil

from cluster.instance import cpu_list
from cluster.workers import WorkerSpec

ENGINES_PER_CORE = 2
"""Engines a core holds by default. Engines beyond the cores share them unbound, one thread
each (`cluster.shape`); two a core is the most this project runs and tests (tests/
test_admin_e2e.py: four engines on two cores), not a measured optimum."""
RESERVE_BYTES = 1 << 30
"""Memory left to everything but the new engines (the serving processes, the page cache)."""
ENGINE_RUNTIME_BYTES = 1536 << 20
"""What a CPU engine's processes take beyond its KV cache, weights and pool segment: Python,
torch and vLLM in its front end, engine core and model worker. Measured: the worker of a
`both` engine started by ResizePool (tests/test_resize_e2e.py; tiny model, eager, float32,
192 MiB KV cache, 15 MiB weights) held 1,680 MiB (PSS of its process tree), so ~1,470."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


@dataclass(frozen=True)
class Machine:
    cores: int
    available_bytes: int
    """Memory the machine can give now (`MemAvailable`)."""

    @classmethod
    def here(cls, cpus: str = "") -> Machine:
        """This machine; `cpus`: its cores where this process is kept to fewer
        (`WorkerSpec.machine_cpus`)."""
        cores = len(cpu_list(cpus)) if cpus else len(os.sched_getaffinity(0))
        return cls(cores, psutil.virtual_memory().available)


def weights_bytes(model: str) -> int:
    """The size of the model's weight files (its memory, at most, in any dtype as small)."""
    root = Path(model)
    if not root.is_dir():
        return 0
    return sum(p.stat().st_size for p in root.rglob("*")
               if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def engine_bytes(spec: WorkerSpec) -> int:
    """What one more engine started from `spec` takes."""
    segment = 0 if spec.pool_store_client else spec.pool_segment_bytes
    return spec.kv_cache_bytes + weights_bytes(spec.model) + segment + ENGINE_RUNTIME_BYTES


@dataclass(frozen=True)
class Capacity:
    engine_bytes: int
    max_engines: int = 0
    """The most engines on the machine; 0: `ENGINES_PER_CORE` per core."""

    def refusal(self, machine: Machine, engines: int, starting: int, new: int) -> str:
        """Why `new` more engines do not fit beside `engines` (`starting` of them still
        loading); "" when they do."""
        cap = self.max_engines or ENGINES_PER_CORE * machine.cores
        if engines + new > cap:
            why = ("--max-engines" if self.max_engines else
                   f"{ENGINES_PER_CORE} per core on {machine.cores} cores; --max-engines")
            return (f"this machine holds at most {cap} engines ({why}): {engines} run or "
                    f"start, {new} more asked")
        need = (starting + new) * self.engine_bytes
        free = machine.available_bytes - RESERVE_BYTES
        if need > free:
            return (f"not enough memory: {starting + new} engine(s) loading would take "
                    f"{need >> 20} MiB ({self.engine_bytes >> 20} MiB each: KV cache, "
                    f"weights, runtime), {max(free, 0) >> 20} MiB available beyond "
                    f"{RESERVE_BYTES >> 20} MiB kept free")
        return ""
