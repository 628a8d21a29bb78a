"""What a worker announces about itself in the membership registry."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any

ROLES = ("prefill", "decode", "both")
PROBE_TOKENS = 512
"""The prompt length a worker times at start (`InstanceInfo.prefill_probe_s`)."""


@dataclass(frozen=True)
class InstanceInfo:
    """One worker instance. Encoded as a JSON object with these fields (those with defaults
    may be absent: older workers), no others.

    Invalid values raise ValueError (TypeError for a wrong type; `from_json` turns both into
    ValueError).
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
        for name in ("instance_id", "address", "model", "version"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a string, not {getattr(self, name)!r}")
        if not self.instance_id or "/" in self.instance_id:
            raise ValueError(f"instance_id must be non-empty without '/': {self.instance_id!r}")
        host, sep, port = self.address.rpartition(":")
        if not (sep and host and port.isdigit()):
            raise ValueError(f"address must be host:port, not {self.address!r}")
        for name in ("block_size", "capacity_tokens", "threads", "max_model_len", "max_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, not {value!r}")
            if value < 0:
                raise ValueError(f"{name} must be non-negative, not {value!r}")
        if self.block_size == 0:
            raise ValueError("block_size must be positive")
        if not isinstance(self.kv_namespace, str) or "/" in self.kv_namespace:
            raise ValueError(f"kv_namespace must be a string without '/': {self.kv_namespace!r}")
        for name in ("cpus", "gpus"):
            try:
                cpu_list(getattr(self, name))
            except (TypeError, ValueError, AttributeError):
                raise ValueError(f"{name} must be a CPU/device list like '0-3,8', not "
                                 f"{getattr(self, name)!r}") from None
        for name in ("started_at", "prefill_probe_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise TypeError(f"{name} must be a number, not {value!r}")
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
