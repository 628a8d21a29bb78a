"""What a worker announces about itself in the membership registry."""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

ROLES = ("prefill", "decode", "both")
PROBE_TOKENS = 512
"""The prompt length a worker times at start (`InstanceInfo.prefill_probe_s`)."""

# What a registration may claim: far beyond any real machine, near enough that nothing built
# from an entry (a core set, a context, a block) can cost the conductor more than a little.
MAX_CPU = 8191
"""The highest CPU number (Linux builds for at most 8192, `NR_CPUS`)."""
MAX_GPU = 1023
"""The highest accelerator number."""
MAX_LIST_CHARS = 8192
"""The longest `cpus` / `gpus` list text."""
MAX_BLOCK_SIZE = 1 << 16
MAX_CAPACITY_TOKENS = 1 << 40
MAX_MODEL_LEN = 1 << 27
MAX_SEQS = 1 << 20
MAX_PROBE_S = 3600.0
MAX_CHARS = {"instance_id": 253, "model": 512, "version": 128, "kv_namespace": 256,
             "address": 261}
"""The longest each string field may be (an address: a 253-character host name, a port)."""

_LIST = re.compile(r"\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*", re.ASCII)
_NAME = re.compile(r"[!-~]+", re.ASCII)  # printable ASCII, no spaces
_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?", re.ASCII)


@dataclass(frozen=True)
class InstanceInfo:
    """One worker instance. Encoded as a JSON object with these fields (those with defaults
    may be absent: older workers), no others.

    Invalid values raise ValueError (TypeError for a wrong type; `from_json` turns both into
    ValueError), out-of-range ones too (`MAX_*`): an entry anyone could write to etcd is
    checked before anything is built from it.
    """

    instance_id: str
    role: str  # "prefill" | "decode" | "both"
    address: str  # host:port of the worker's gRPC server
    model: str
    block_size: int  # tokens per KV block
    capacity_tokens: int  # KV-cache capacity, in tokens
    version: str
    started_at: float = field(default_factory=time.time)  # Unix time
    kv_namespace: str = ""  # prefix of its blocks' pool keys (model and KV layout)
    cpus: str = ""  # the cores its engine computes on, as a Linux CPU list ("0-3,8"); "": unknown
    threads: int = 0  # its engine's compute threads (CPU); 0: unknown
    gpus: str = ""  # the accelerators it computes on ("0,1"); "": none
    max_model_len: int = 0  # its engine's context, in tokens; 0: unknown (the model's own)
    max_seqs: int = 0  # sequences its engine batches at once (max_num_seqs); 0: unknown
    prefill_probe_s: float = 0.0
    """Seconds its engine took at start to prefill `PROBE_TOKENS` tokens (the better of two
    runs): the conductor's first estimate of its speed; 0: not measured."""
    side: bool = False
    """Its engine computes on the cores of the serving processes (`cluster.shape.Engine.side`),
    whose work it then delays: the policy prices it higher (`SchedulerParams.side_cost`)."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {self.role!r}")
        for name, most in MAX_CHARS.items():
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"{name} must be a string, not {value!r}")
            if len(value) > most:
                raise ValueError(f"{name} longer than {most} characters")
            if not (value.isprintable() if name in ("model", "version")
                    else not value or _NAME.fullmatch(value)):
                raise ValueError(f"{name} has characters it cannot hold: {value!r}")
        if not self.instance_id or "/" in self.instance_id:
            raise ValueError(f"instance_id must be non-empty without '/': {self.instance_id!r}")
        _check_address(self.address)
        for name, most in (("block_size", MAX_BLOCK_SIZE), ("capacity_tokens",
                           MAX_CAPACITY_TOKENS), ("threads", MAX_CPU + 1),
                           ("max_model_len", MAX_MODEL_LEN), ("max_seqs", MAX_SEQS)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, not {value!r}")
            if not 0 <= value <= most:
                raise ValueError(f"{name} must be in [0, {most}], not {value!r}")
        if self.block_size == 0:
            raise ValueError("block_size must be positive")
        if "/" in self.kv_namespace:
            raise ValueError(f"kv_namespace must be a string without '/': {self.kv_namespace!r}")
        for name, most in (("cpus", MAX_CPU), ("gpus", MAX_GPU)):
            _check_list(name, getattr(self, name), most)
        for name, most in (("started_at", math.inf), ("prefill_probe_s", MAX_PROBE_S)):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise TypeError(f"{name} must be a number, not {value!r}")
            if not (math.isfinite(value) and value <= most):
                raise ValueError(f"{name} must be finite and at most {most}, not {value!r}")
            object.__setattr__(self, name, float(value))
        if not isinstance(self.side, bool):
            raise TypeError(f"side must be a bool, not {self.side!r}")
        if not self.prefill_probe_s >= 0:
            raise ValueError(f"prefill_probe_s must be >= 0, not {self.prefill_probe_s!r}")

    @property
    def host(self) -> str:
        return self.address.rpartition(":")[0]

    @property
    def can_prefill(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def can_decode(self) -> bool:
        return self.role in ("decode", "both")

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> InstanceInfo:
        """Decode; ValueError on bad JSON, unknown or missing keys, or invalid values."""
        obj: Any = json.loads(data)
        if not isinstance(obj, dict):
            raise ValueError(f"InstanceInfo JSON must be an object, not {type(obj).__name__}")
        fields = dataclasses.fields(cls)
        names = {f.name for f in fields}
        required = {f.name for f in fields if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING}
        unknown, missing = set(obj) - names, required - set(obj)
        if unknown or missing:
            raise ValueError(
                f"InstanceInfo JSON: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}"
            )
        try:
            return cls(**obj)
        except TypeError as e:
            raise ValueError(f"InstanceInfo JSON: {e}") from e


def _check_address(address: str) -> None:
    """`host:port`: a host name or IPv4 address, or an IPv6 one in brackets; port 1-65535."""
    host, sep, port = address.rpartition(":")
    ok = bool(sep) and port.isascii() and port.isdigit() and 0 < int(port) < 65536
    if ok and host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            ok = False
    elif ok:
        ok = bool(_HOST.fullmatch(host))
    if not ok:
        raise ValueError(f"address must be host:port, not {address!r}")


def _check_list(name: str, text: object, most: int) -> None:
    """A CPU/device list of numbers up to `most`, checked without building it."""
    if not (isinstance(text, str) and len(text) <= MAX_LIST_CHARS
            and (not text or _LIST.fullmatch(text))):
        raise ValueError(f"{name} must be a CPU/device list like '0-3,8' (at most "
                         f"{MAX_LIST_CHARS} characters), not {str(text)[:40]!r}")
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        if not int(lo) <= int(hi or lo) <= most:
            raise ValueError(f"{name}: bad range {part!r} (numbers up to {most})")


def host_port(host: str, port: int) -> str:
    """The `address` of a worker at `host` (an IPv6 address gets its brackets)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def cpu_list(text: str) -> frozenset[int]:
    """A Linux CPU list ("0-3,8") as the set of its numbers; "" is the empty set."""
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi or lo)
        if a < 0 or b < a:
            raise ValueError(f"bad range {part!r}")
        out.update(range(a, b + 1))
    return frozenset(out)


def format_cpu_list(cpus: set[int] | frozenset[int]) -> str:
    """The inverse of `cpu_list`: runs of consecutive numbers as ranges."""
    runs: list[tuple[int, int]] = []
    for c in sorted(cpus):
        if runs and runs[-1][1] == c - 1:
            runs[-1] = (runs[-1][0], c)
        else:
            runs.append((c, c))
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
