"""What every engine of a cluster is started with, and its defaults, in one place.

The launcher's `ClusterSpec`, the workers' `WorkerSpec` and bench-e2e's `Engines` extend
`EngineSpec` (its fields are keyword-only), and hand it on with `engine_kwargs()`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    block_size: int = 32
    max_model_len: int = 2048
    dtype: str = "auto"
    """"auto": as `vllm serve` resolves it for the model and platform (`worker.dtype`;
    bfloat16 on this machine), or float32, bfloat16, float16."""
    kv_cache_bytes: int = 256 << 20
    """Each engine's KV cache."""
    pool_segment_bytes: int = 256 << 20
    """The pool memory each engine's worker contributes (without a shared store client)."""
    enforce_eager: bool = True
    """Eager PyTorch (engines up in ~20 s: tests) or vLLM's compiled graphs (~1 ms faster per
    step for the tiny model here, ~45 s more to start: `make run`)."""
    lease_ttl: float = 10.0
    """Each worker's etcd lease: how long a silent worker stays registered."""
    kv_checksum: bool = False
    """Pool objects carry their block's digest, verified on load (`store.checksum`)."""

    def engine_kwargs(self) -> dict[str, Any]:
        """These settings as keyword arguments, for the next spec down."""
        return {f.name: getattr(self, f.name) for f in fields(EngineSpec)}
