"""Latency profiles as data: the prefill-time and TBT models, the transfer cost and the
memory sizes of one instance, loaded from `simulator/profiles/*.json`.

The models have the conductor's own shapes (`PrefillTimeModel`, `TbtModel`), so a profile
is at once the simulated machine and the conductor's (here perfect) fitted model of it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from conductor.scheduler import PrefillTimeModel, TbtModel

PROFILES = Path(__file__).parent / "profiles"


@dataclass(frozen=True)
class LatencyProfile:
    name: str
    source: str
    """Where the numbers come from and how to regenerate them."""
    block_size: int
    """Tokens per KV block in the simulated engines (must divide the trace's 512)."""
    prefill: PrefillTimeModel
    tbt: TbtModel
    transfer_s_per_block: float
    transfer_s_fixed: float
    kv_capacity_tokens: int
    """Decode KV cache per instance, tokens (prompt + output of running requests)."""
    local_cache_blocks: int
    """Prefix cache each engine keeps of its own (device + host memory), blocks."""

    def __post_init__(self) -> None:
        if self.block_size <= 0 or 512 % self.block_size:
            raise ValueError(f"block_size must divide 512: {self.block_size}")
        if self.transfer_s_per_block < 0 or self.transfer_s_fixed < 0:
            raise ValueError("transfer times must be >= 0")

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(data: dict) -> LatencyProfile:
        known = set(LatencyProfile.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown profile keys: {sorted(unknown)}")
        return LatencyProfile(**{**data, "prefill": PrefillTimeModel(**data["prefill"]),
                                 "tbt": TbtModel(**data["tbt"])})


def load_profile(name_or_path: str) -> LatencyProfile:
    """A profile by name (`simulator/profiles/<name>.json`) or path."""
    p = Path(name_or_path)
    if not p.exists():
        p = PROFILES / f"{name_or_path}.json"
    return LatencyProfile.from_json(json.loads(p.read_text()))


def paper_profile(layers: int = 80, hidden: int = 8192, kv_heads: int = 8, head_dim: int = 128,
                  params_b: float = 70.0, gpus: int = 8, tflops_per_gpu: float = 312.0,
                  mfu: float = 0.5, hbm_tb_s: float = 2.0, hbm_gb: float = 80.0,
                  net_gb_s: float = 100.0, block_size: int = 512) -> LatencyProfile:
    """Mooncake's cost model for LLaMA2-70B on one 8x A800-80GB instance (defaults).

    Prefill FLOPs `l * (a n^2 d + b n d^2)`, a=4, b=22; computing u tokens after a cached
    prefix c costs the difference, `l * (b d^2 u + 2 a d u (c + u/2))` FLOPs, at
    `gpus * tflops * mfu`. Decode is bandwidth-bound: one step reads the fp16 weights and
    each running sequence's KV (`2 * l * kv_heads * head_dim * 2` bytes per token) from HBM.
    Blocks move over `net_gb_s` (RDMA). The decode KV cache is HBM left after the weights.
    """
    a, b = 4, 22
    flops = gpus * tflops_per_gpu * 1e12 * mfu
    hbm = gpus * hbm_tb_s * 1e12
    kv_bytes_per_token = 2 * layers * kv_heads * head_dim * 2
    weights = params_b * 1e9 * 2
    return LatencyProfile(
        name="paper_llama2_70b",
        source=("Mooncake cost model (a=4, b=22) for LLaMA2-70B (l=80, d=8192, GQA 8x128) on "
                f"{gpus}x A800-80GB at {tflops_per_gpu:g} TFLOP/s x {mfu:g} MFU, "
                f"{hbm_tb_s:g} TB/s HBM, {net_gb_s:g} GB/s RDMA; regenerate with "
                "`python -m simulator.profile`"),
        block_size=block_size,
        prefill=PrefillTimeModel(base_s=0.02, per_token_s=layers * b * hidden**2 / flops,
                                 per_attn_s=2 * layers * a * hidden / flops),
        tbt=TbtModel(base_s=weights / hbm + 0.002, per_seq_s=2 * params_b * 1e9 / flops,
                     per_kv_token_s=kv_bytes_per_token / hbm),
        transfer_s_per_block=kv_bytes_per_token * block_size / (net_gb_s * 1e9),
        transfer_s_fixed=1e-3,
        kv_capacity_tokens=int((gpus * hbm_gb * 1e9 * 0.9 - weights) / kv_bytes_per_token),
        local_cache_blocks=int(gpus * hbm_gb * 1e9 * 0.1 / (kv_bytes_per_token * block_size))
        + int(1024e9 / (kv_bytes_per_token * block_size)),
    )


if __name__ == "__main__":
    prof = paper_profile()
    out = PROFILES / f"{prof.name}.json"
    out.write_text(json.dumps(prof.to_json(), indent=2) + "\n")
    print(out)
