"""How to start a worker process on this machine: what the embedded launcher uses, and what it
hands the conductor (as JSON) so that `ResizePool` can start more of them in embedded mode."""

from __future__ import annotations

import json
import os
import sys
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

from cluster import loopback
from cluster.engine_spec import EngineSpec
from cluster.instance import cpu_list
from cluster.ports import free_port
from cluster.process import ManagedProcess, children_on, vllm_scratch
from cluster.shape import (
    BACKGROUND_ENV,
    SPIN_ENV,
    STEP_CONTEXT_ENV,
    STEP_MS_ENV,
    STEP_TOKENS_ENV,
    WORKER_SPIN_ENV,
    Engine,
)

ROLES = ("prefill", "decode", "both")
CPU_ENGINE_SPIN_S = "0.01"
"""How long the vLLM processes of a CPU engine busy-wait for the next message
(`worker/vllm_plugin.py`, `Engine.busy_wait`; 0 hung the engine)."""
VLLM_STEP_TOKENS = 2048
"""vLLM's default budget (`max_num_batched_tokens` of a served CPU engine): the budget of a
step with no stream to hold up, where the streams' own is smaller (`worker.step_budget`)."""
VLLM_SPIN_S = "1"
"""vLLM's own: for the model worker of an engine with a core of its own."""


@dataclass(frozen=True)
class WorkerSpec(EngineSpec):
    """How to start a worker here (`start`), with the cluster's `EngineSpec`."""

    model: str
    etcd: str
    pool_master: str
    pool_metadata: str
    run_dir: str
    """Each worker's log goes to `<run_dir>/<instance_id>.log`."""
    pool_store_client: str = ""
    pool_store_client_segment: str = ""
    """This host's `mooncake_client` and its segment (see WorkerConfig); empty: TCP."""
    env: tuple[tuple[str, str], ...] = ()
    python: str = sys.executable
    secret_file: str = ""
    """The cluster secret every worker is started with (`cluster.secret`); "": none."""
    tls_dir: str = ""
    """The worker plane's TLS files every worker serves with (`cluster.plane_tls`); "": none."""
    step_target_ms: float = 0.0
    """How long a step beside streams may take, for engines with a `step_context`: the
    launcher's `cluster.shape.step_target_ms` of the conductor's TBT SLO; 0: their token
    budget alone (`worker.step_budget`)."""
    machine_cpus: str = ""
    """Where an engine without cores of its own (unplaced: `ResizePool`, tests) computes when
    the worker is started from a process kept to the serving cores; "": where it starts."""
    allow_wildcard_binds: bool = False
    """Start workers even where their engines' Mooncake listeners cannot be kept on
    loopback (`cluster.loopback`); else that is `LoopbackUnavailable`."""
    serving_cpus: str = ""
    """Where the worker's own process (its front end) runs (`Shape.serving_cpus`), whoever
    starts it: the launcher, or the conductor (`ResizePool`), which may run elsewhere
    (`Shape.conductor_cpus`); "": where its starter runs."""

    def save(self, path: Path | str) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path | str) -> WorkerSpec:
        raw = json.loads(Path(path).read_text())
        raw["env"] = tuple(tuple(kv) for kv in raw.get("env", ()))
        return cls(**raw)

    def start(self, role: str, instance_id: str, port: int = 0,
              placement: Engine | None = None) -> tuple[ManagedProcess, int]:
        """Start one worker (its engine loads in the background); returns it and its port.
        `placement`: its engine's cores and threads (`cluster.shape`), else unbound (then the
        spec's `env` decides)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        port = port or free_port()
        module = "decode_worker" if role == "decode" else "prefill_worker"  # --role overrides
        argv = [
            self.python, "-m", module,
            "--model", self.model, "--etcd", self.etcd,
            "--pool-master", self.pool_master, "--pool-metadata", self.pool_metadata,
            "--port", str(port), "--instance-id", instance_id,
            "--block-size", str(self.block_size), "--max-model-len", str(self.max_model_len),
            "--dtype", self.dtype, "--kv-cache-bytes", str(self.kv_cache_bytes),
            "--pool-segment-bytes", str(self.pool_segment_bytes),
            "--lease-ttl", str(self.lease_ttl),
            "--enforce-eager", str(self.enforce_eager).lower(),
            "--kv-checksum", str(self.kv_checksum).lower(),
        ]
        if role == "both":
            argv += ["--role", "both"]
        bound = placement is not None and placement.cpu_bind != "nobind"
        home = "" if placement is not None and placement.gpu else (
            placement.cpu_bind if bound else self.machine_cpus)
        if home:  # its engine's processes on its own cores, not the serving processes'
            argv += ["--engine-cpus", home]
        if placement is not None and placement.engine_core_cpus:
            argv += ["--engine-core-cpus", placement.engine_core_cpus]
        if placement is not None and placement.side:
            argv += ["--side", "true"]
        if placement is not None and placement.step_tokens and (
                not placement.step_context or placement.step_tokens > VLLM_STEP_TOKENS):
            # fixed; or the streams' budget above vLLM's, which is then every step's
            argv += ["--max-num-batched-tokens", str(placement.step_tokens)]
        if self.secret_file:
            argv += ["--secret-file", self.secret_file]
        if self.tls_dir:
            argv += ["--tls-dir", self.tls_dir]
        if self.pool_store_client:
            argv += ["--pool-store-client", self.pool_store_client,
                     "--pool-store-client-segment", self.pool_store_client_segment]
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if placement is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = placement.cpu_bind
            env["OMP_NUM_THREADS"] = str(placement.threads)
            if placement.gpu:
                env["CUDA_VISIBLE_DEVICES"] = placement.gpu
        if placement is None or not placement.busy_wait:  # unplaced: floats over every core
            env[SPIN_ENV] = CPU_ENGINE_SPIN_S
            if placement is not None and placement.engine_core_cpus:  # a core of its own
                env[WORKER_SPIN_ENV] = VLLM_SPIN_S
        if placement is not None and placement.background:
            env[BACKGROUND_ENV] = "1"
        if placement is not None and placement.step_tokens and placement.step_context:
            env[STEP_CONTEXT_ENV] = str(placement.step_context)
            env[STEP_TOKENS_ENV] = str(placement.step_tokens)
            if self.step_target_ms > 0:
                env[STEP_MS_ENV] = f"{self.step_target_ms:g}"
        env.update(dict(self.env))
        # its worker binds loopback (WorkerConfig.host), and so does its engine's Mooncake
        env = loopback.env("127.0.0.1", env, allow_wildcard=self.allow_wildcard_binds)
        # the launcher removes its engine's sockets, also when it was killed
        proc = ManagedProcess(instance_id, argv, Path(self.run_dir) / f"{instance_id}.log",
                              env=env, scratch=vllm_scratch(env))
        with children_on(cpu_list(self.serving_cpus)) if self.serving_cpus else nullcontext():
            return proc.start(), port
