"""The conductor's configuration, validated in one place, from CLI flags and environment."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields

from cluster.etcd_access import EtcdAccess
from cluster.instance import MAX_BLOCK_SIZE
from cluster.plane_tls import PlaneTLS
from cluster.secret import LOOPBACK, ClusterSecret
from conductor.auth import load_api_keys
from conductor.scheduler.policy import DEFAULT_POLICY
from conductor.scheduler.policy import POLICIES as _POLICY_TABLE
from conductor.tenants import Limits, load_limits

POLICIES = tuple(_POLICY_TABLE)
DISAGGREGATE = ("auto", "always", "never")


@dataclass(frozen=True)
class ConductorConfig:
    model: str
    """Local model directory: the tokenizer (and chat template) the conductor uses."""
    etcd: str
    """etcd endpoint host:port, where workers register."""
    served_model_name: str = ""
    """The name clients pass as `model`; defaults to the model directory's name."""
    host: str = "127.0.0.1"
    port: int = 8000
    http_keep_alive_s: int = 75
    """An idle client connection stays open this long. Longer than HTTP clients' own idle
    expiry (httpx and the OpenAI SDK: 5 s, aiohttp: 15 s): at equal times a client can send on
    a connection the conductor is closing and meet a reset, not an answer."""
    http_head_timeout_s: float = 15.0
    """A request's head (request line and headers) must arrive within this long of its first
    byte (or of the connection being opened), else the connection is closed."""
    http_body_timeout_s: float = 30.0
    """A request's body must arrive within this long of its head, else 408."""
    http_send_timeout_s: float = 30.0
    """A client that reads nothing of its answer for this long (the server cannot send) is
    disconnected, and a stream's engine work aborted."""
    policy: str = DEFAULT_POLICY
    """Routing policy: kv_centric | cache_aware | least_loaded | round_robin | random."""
    membership_prefix: str = "/kvcluster/instances/"
    control_prefix: str = ""
    """The etcd key prefix of the control state that every conductor of the cluster shares and
    follows (`conductor.control_state`): drains and role switches, the default SLOs, the
    policy, tenants' limits, the fitted time models. Empty: beside `membership_prefix` (its
    parent + `control/`: `/kvcluster/control/` by default)."""
    control_models_s: float = 30.0
    """How often the fitted time models are written to the control state, when something was
    timed since. Every conductor merges the timings the others wrote; one that starts prices
    with them."""
    prefill_timeout_s: float = 120.0
    """Deadline of one prefill RPC."""
    pool_wait_margin_s: float = 0.5
    """A decode started beside its prefill (`--disaggregate`) waits for the prefill's blocks up
    to twice the predicted TTFT plus this (at most `prefill_timeout_s`), then computes what has
    not arrived itself."""
    first_token_timeout_s: float = 120.0
    """Deadline for the decode worker's first chunk."""
    request_timeout_s: float = 600.0
    """Deadline of a whole request."""
    stall_timeout_s: float = 0.0
    """A decode stream that sends nothing for this long after its first chunk has stalled (a
    stopped or wedged worker): it continues on another decode instance, like a broken one.
    0: 30 x the request's TBT SLO, at least 10 s (a long prefill sharing the engine's steps
    is a gap, not a stall)."""
    block_size: int = 0
    """The cluster's block size: an instance registered with another is not routed
    (`mismatched`). 0: the block size most of the verified instances hold."""
    ttft_slo_s: float = 30.0
    """Default time-to-first-token SLO: kv_centric answers 429 when no pair is predicted to
    meet it."""
    tbt_slo_s: float = 0.3
    """Default time-between-tokens SLO a decode instance must be predicted to keep."""
    disaggregate: str = "auto"
    """kv_centric: auto (per request, prefill on another instance or on the decode instance
    itself, whichever the models say costs less), always (on another one whenever one can:
    Mooncake's shape), never (always on the decode instance)."""
    pool_gbps: float = 1.0
    """Pool-to-engine transfer bandwidth (GB/s) assumed until the workers have measured it."""
    index_max_blocks: int = 1_000_000
    """The KV index forgets the least recently stored blocks beyond this many."""
    predicted_ttl_s: float = 10.0
    """How long a routed request's predicted blocks count without an event confirming them."""
    pool_keys_url: str = ""
    """The Mooncake master's HTTP server (its metrics port, e.g. http://127.0.0.1:9003): the
    index follows the pool's key listing there (evictions, restarts). Empty: off."""
    pool_sync_s: float = 10.0
    """How often the pool's key listing is read."""
    kv_events: bool = True
    """Follow the workers' KV event streams (exact local caches); off: replies only."""
    admin_host: str = "127.0.0.1"
    admin_port: int = 0
    """The gRPC admin API (`protos/admin.proto`); 0 leaves it off."""
    admin_token: str = ""
    """Admin calls need `authorization: Bearer <token>` when set (prefer the file or the
    environment: a flag shows in `ps`)."""
    admin_token_file: str = ""
    """A file holding the admin token (read once at start)."""
    secret_file: str = ""
    """A file holding the cluster secret (`cluster.secret`): set, every Worker call carries
    the token derived from it and an instance is routed to only once it proved it holds the
    same secret (and reports the registration it has in etcd, as without a secret). Empty:
    the worker plane is open (loopback-only clusters)."""
    etcd_access_file: str = ""
    """etcd's TLS material and user (`cluster.etcd_access`, a TOML file); empty: plain etcd."""
    tls_dir: str = ""
    """Call the workers over mutual TLS with the files here (`cluster.plane_tls`; the workers
    need the same directory). Empty: plaintext."""
    embedded_workers: str = ""
    """Embedded mode: a `cluster.workers.WorkerSpec` JSON file; ResizePool then starts worker
    processes on this machine. Empty: a deployed cluster (drain and switch only)."""
    max_engines: int = 0
    """Embedded mode: the most engines ResizePool lets run on this machine, every instance
    the conductor knows counted (`cluster.capacity`); 0: two per core."""
    breaker_cooldown_s: float = 2.0
    """An instance whose circuit breaker opened (unreachable, or 3 failed calls in a row) is
    not routed to for this long, then tried again."""
    retry_budget: float = 0.2
    """Retries (and stream migrations) on other instances may number this share of the
    requests of the last 10 s, plus 3: beyond it a failure is the answer, so that failures
    never multiply the load. A request's own retries are at most 2 whatever this is."""
    tenant_limits_file: str = ""
    """Tenants' limits at start: a TOML file of `[tenants.<name>]` tables with
    `max_concurrency`, `tokens_per_s`, `priority` (interactive | batch) and `may_loosen_slo`
    (`[tenants."*"]`: every other tenant's); `conductorctl tenant` changes them at run time.
    Empty: no limits. Tenants are named by API key (`api_keys_file`)."""
    batch_slo_share: float = 0.5
    """`batch` requests are routed under this share of the SLOs: they take only the headroom
    interactive requests leave, and wait in the batch queue otherwise."""
    batch_max_wait_s: float = 60.0
    """How long a `batch` request may wait in the batch queue for room before it is refused
    (429, `batch_queue_timeout`)."""
    batch_queue_max: int = 256
    """`batch` requests waiting at once; beyond, 429 (`batch_queue_full`)."""
    max_in_flight: int = 1024
    """Requests the conductor holds at once; beyond it new ones get 429 at once."""
    max_body_bytes: int = 16 << 20
    """A request body larger than this gets 413 unread (a prompt fills the context with
    far less)."""
    health_interval_s: float = 1.0
    """Each instance's gRPC health service is checked this often; one that does not answer
    SERVING within the interval is taken out of routing until it does."""
    stats_interval_s: float = 5.0
    """Each instance's `Stats` are polled this often for the pool metrics on /metrics."""
    api_key: str = ""
    """When set, /v1 routes need `Authorization: Bearer <api_key>` (401 otherwise); /health,
    /metrics and the OpenAPI description stay open. Empty: no key."""
    api_keys_file: str = ""
    """API keys with their tenants, one `<key> <tenant>` per line (`#` comments): /v1 routes
    then need one of them (or `api_key`, tenant ""), and each tenant's requests are salted
    apart (`conductor.auth.tenant_salt`): no tenant's cached prefixes show in another's
    `cached_tokens`, `kv_transfer` or timings. Read once at start."""
    hide_kv_transfer: bool = False
    """Leave the `kv_transfer` details (instances, blocks moved) out of answers."""

    otel_endpoint: str = ""
    """OTLP/gRPC collector for request spans (`conductor/tracing.py`); empty: the SDK's
    `OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_TRACES_EXPORTER` environment, else no spans."""

    @property
    def api_keys(self) -> dict[str, str]:
        """Every API key -> its tenant; empty: no key needed."""
        return self._keys  # type: ignore[attr-defined]

    @property
    def tenant_limits(self) -> dict[str, Limits]:
        """The tenants' limits at start (`tenant_limits_file`)."""
        return self._tenant_limits  # type: ignore[attr-defined]

    @property
    def cluster_secret(self) -> ClusterSecret | None:
        return self._secret  # type: ignore[attr-defined]

    @property
    def tls(self) -> PlaneTLS | None:
        return self._tls  # type: ignore[attr-defined]

    @property
    def etcd_access(self) -> EtcdAccess:
        return self._etcd_access  # type: ignore[attr-defined]

    def stall_s(self, tbt_slo_s: float | None) -> float:
        """The inter-chunk deadline of a decode stream whose TBT SLO is `tbt_slo_s`."""
        return self.stall_timeout_s or max(30 * (tbt_slo_s or self.tbt_slo_s), 10.0)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not os.path.isdir(self.model):
            raise ValueError(f"model must be a local model directory: {self.model!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port out of range: {self.port}")
        for name in ("prefill_timeout_s", "first_token_timeout_s", "request_timeout_s",
                     "ttft_slo_s", "tbt_slo_s", "pool_gbps", "index_max_blocks",
                     "predicted_ttl_s", "health_interval_s", "breaker_cooldown_s",
                     "pool_sync_s", "stats_interval_s", "control_models_s",
                     "max_in_flight", "max_body_bytes", "pool_wait_margin_s",
                     "http_keep_alive_s", "http_head_timeout_s", "http_body_timeout_s",
                     "http_send_timeout_s", "batch_max_wait_s", "batch_queue_max"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if not 0 < self.batch_slo_share <= 1:
            raise ValueError(f"batch_slo_share must be in (0, 1], got {self.batch_slo_share}")
        if not 0 <= self.retry_budget <= 10:
            raise ValueError(f"retry_budget must be in [0, 10], got {self.retry_budget}")
        if not 0 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be in [0, {MAX_BLOCK_SIZE}], got {self.block_size}")
        if self.stall_timeout_s < 0:
            raise ValueError("stall_timeout_s must be 0 (derived) or positive")
        if not self.control_prefix:
            parent = self.membership_prefix.rstrip("/")
            object.__setattr__(self, "control_prefix",
                               parent[:parent.rfind("/") + 1] + "control/")
        if (self.control_prefix.startswith(self.membership_prefix)
                or self.membership_prefix.startswith(self.control_prefix)):
            raise ValueError(f"control_prefix {self.control_prefix!r} and membership_prefix "
                             f"{self.membership_prefix!r} must not contain one another")
        if self.disaggregate not in DISAGGREGATE:
            raise ValueError(f"disaggregate must be one of {DISAGGREGATE}, got "
                             f"{self.disaggregate!r}")
        if not 0 <= self.admin_port < 65536:
            raise ValueError(f"admin_port out of range: {self.admin_port}")
        if self.admin_token_file:
            try:
                token = open(self.admin_token_file).read().strip()
            except OSError as e:
                raise ValueError(f"admin_token_file unreadable: {e}") from e
            if not token:
                raise ValueError(f"admin_token_file is empty: {self.admin_token_file}")
            if self.admin_token and self.admin_token != token:
                raise ValueError("admin_token and admin_token_file disagree; set one")
            object.__setattr__(self, "admin_token", token)
        if (self.admin_port and not self.admin_token
                and self.admin_host not in LOOPBACK):
            raise ValueError("an admin API reachable beyond loopback needs an admin token "
                             "(admin_token_file)")
        object.__setattr__(self, "_secret", ClusterSecret.load(self.secret_file))
        object.__setattr__(self, "_tls", PlaneTLS.load(self.tls_dir, "client"))
        object.__setattr__(self, "_etcd_access", EtcdAccess.load(self.etcd,
                                                                 self.etcd_access_file))
        object.__setattr__(self, "_keys", load_api_keys(self.api_keys_file, self.api_key))
        object.__setattr__(self, "_tenant_limits", load_limits(self.tenant_limits_file))
        if self.max_engines < 0:
            raise ValueError(f"max_engines must be >= 0, got {self.max_engines}")
        if self.embedded_workers and not os.path.isfile(self.embedded_workers):
            raise ValueError(f"embedded_workers is not a file: {self.embedded_workers!r}")
        if not self.served_model_name:
            object.__setattr__(self, "served_model_name", os.path.basename(self.model.rstrip("/")))


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


_TYPES = {"str": str, "int": int, "float": float, "bool": _bool}


def parse_args(argv: list[str] | None = None) -> ConductorConfig:
    """Flags override `KVCLUSTER_CONDUCTOR_<FIELD>` environment variables override defaults."""
    p = argparse.ArgumentParser(prog="conductor", description="The KV-centric conductor.")
    for f in fields(ConductorConfig):
        env = os.environ.get(f"KVCLUSTER_CONDUCTOR_{f.name.upper()}")
        p.add_argument("--" + f.name.replace("_", "-"), type=_TYPES[str(f.type)], default=env)
    ns = p.parse_args(argv)
    kwargs = {k: v for k, v in vars(ns).items() if v is not None}
    for required in ("model", "etcd"):
        if required not in kwargs:
            p.error(f"missing --{required}")
    try:
        return ConductorConfig(**kwargs)
    except ValueError as e:  # a bad setting: one line naming it, not a traceback
        p.error(str(e))
