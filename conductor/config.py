"""The conductor's configuration, validated in one place, from CLI flags and environment."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields

POLICIES = ("least_loaded",)


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
    policy: str = "least_loaded"
    membership_prefix: str = "/kvcluster/instances/"
    prefill_timeout_s: float = 120.0
    """Deadline of one prefill RPC."""
    first_token_timeout_s: float = 120.0
    """Deadline for the decode worker's first chunk."""
    request_timeout_s: float = 600.0
    """Deadline of a whole request."""
    block_size: int = 0
    """Block size used when no worker has registered yet; 0 means take the workers'."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not os.path.isdir(self.model):
            raise ValueError(f"model must be a local model directory: {self.model!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port out of range: {self.port}")
        for name in ("prefill_timeout_s", "first_token_timeout_s", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if not self.served_model_name:
            object.__setattr__(self, "served_model_name", os.path.basename(self.model.rstrip("/")))


_TYPES = {"str": str, "int": int, "float": float}


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
    return ConductorConfig(**kwargs)
