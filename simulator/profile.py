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

    @staticmethod
    def from_models(prefill: PrefillTimeModel, tbt: TbtModel, transfer_s_per_block: float,
                    block_size: int, kv_capacity_tokens: int, local_cache_blocks: int,
                    transfer_s_fixed: float = 1e-3, name: str = "fitted") -> LatencyProfile:
        """A profile from a conductor's fitted models (`SchedulerParams.prefill`, `.tbt`,
        `.transfer_s_per_block`) and its engines' memory: what `simulator.planner.plan`
        needs to plan on a live cluster's own figures."""
        return LatencyProfile(name=name, source="the conductor's fitted models",
                              block_size=block_size, prefill=prefill, tbt=tbt,
                              transfer_s_per_block=transfer_s_per_block,
                              transfer_s_fixed=transfer_s_fixed,
                              kv_capacity_tokens=kv_capacity_tokens,
                              local_cache_blocks=local_cache_blocks)

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


def cost_model_profile(name: str, source: str, layers: int, hidden: int, kv_heads: int,
                       head_dim: int, params_b: float, gpus: int, tflops_per_gpu: float,
                       mfu: float, hbm_tb_s: float, hbm_gb: float, net_gb_s: float,
                       dram_gb: float, block_size: int = 512) -> LatencyProfile:
    """Mooncake's cost model for a dense transformer on one instance of `gpus` GPUs.

    Prefill FLOPs `l * (a n^2 d + b n d^2)`, a=4, b=22; computing u tokens after a cached
    prefix c costs the difference, `l * (b d^2 u + 2 a d u (c + u/2))` FLOPs, at
    `gpus * tflops * mfu`. Decode is bandwidth-bound: one step reads the fp16 weights and
    each running sequence's KV (`2 * l * kv_heads * head_dim * 2` bytes per token) from HBM,
    plus 2 ms of fixed step cost. Blocks move over `net_gb_s` (RDMA). The decode KV cache is
    90% of HBM less the weights; each engine's own prefix cache is the other 10% of HBM plus
    `dram_gb` of host memory.
    """
    a, b = 4, 22
    flops = gpus * tflops_per_gpu * 1e12 * mfu
    hbm = gpus * hbm_tb_s * 1e12
    kv_bytes_per_token = 2 * layers * kv_heads * head_dim * 2
    weights = params_b * 1e9 * 2
    block_bytes = kv_bytes_per_token * block_size
    return LatencyProfile(
        name=name,
        source=source,
        block_size=block_size,
        prefill=PrefillTimeModel(base_s=0.02, per_token_s=layers * b * hidden**2 / flops,
                                 per_attn_s=2 * layers * a * hidden / flops),
        tbt=TbtModel(base_s=weights / hbm + 0.002, per_seq_s=2 * params_b * 1e9 / flops,
                     per_kv_token_s=kv_bytes_per_token / hbm),
        transfer_s_per_block=block_bytes / (net_gb_s * 1e9),
        transfer_s_fixed=1e-3,
        kv_capacity_tokens=int((gpus * hbm_gb * 1e9 * 0.9 - weights) / kv_bytes_per_token),
        local_cache_blocks=int(gpus * hbm_gb * 1e9 * 0.1 / block_bytes)
        + int(dram_gb * 1e9 / block_bytes),
    )


def paper_profile() -> LatencyProfile:
    """LLaMA2-70B on one 8x A800-80GB instance, as the Mooncake paper simulates it."""
    return cost_model_profile(
        "paper_llama2_70b",
        "Mooncake cost model (a=4, b=22) for LLaMA2-70B (l=80, d=8192, GQA 8x128) on "
        "8x A800-80GB at 312 TFLOP/s x 0.5 MFU, 2 TB/s HBM, 100 GB/s RDMA; regenerate with "
        "`python -m simulator.profile`",
        layers=80, hidden=8192, kv_heads=8, head_dim=128, params_b=70.0, gpus=8,
        tflops_per_gpu=312.0, mfu=0.5, hbm_tb_s=2.0, hbm_gb=80.0, net_gb_s=100.0,
        dram_gb=1024.0)


def h100_llama31_8b_profile() -> LatencyProfile:
    """Llama-3.1-8B on one H100 SXM per instance, derived the same way from published
    figures (the sources are in the profile's `source`)."""
    return cost_model_profile(
        "h100_llama31_8b",
        "Mooncake cost model (a=4, b=22, as for the paper's profile; Llama-3.1-8B's own "
        "layer count gives b~22.4, within 2%) for Llama-3.1-8B (meta-llama/Llama-3.1-8B "
        "config.json: l=32, d=4096, 32 heads, GQA 8 KV heads x 128, 8.03B parameters, bf16) "
        "on one H100 SXM5-80GB (NVIDIA H100 datasheet: 989 TFLOP/s dense BF16, 3.35 TB/s "
        "HBM3, 80 GB) at 0.5 MFU (the paper profile's assumption), one ConnectX-7 400 Gb/s "
        "NIC per GPU (50 GB/s, as in a DGX H100) and 256 GB of host memory per GPU (a DGX "
        "H100's 2 TB over 8 GPUs). Prefill 23.9 us/token + 2.1 ns/token^2; decode step 6.8 ms "
        "+ 32 us/sequence + 39 ns/KV token; 1.34 ms per 512-token block (67 MB); decode KV "
        "427k tokens; prefix cache 3,933 blocks. Regenerate with `python -m simulator.profile`",
        layers=32, hidden=4096, kv_heads=8, head_dim=128, params_b=8.03, gpus=1,
        tflops_per_gpu=989.0, mfu=0.5, hbm_tb_s=3.35, hbm_gb=80.0, net_gb_s=50.0,
        dram_gb=256.0)


BUILDERS = {"paper_llama2_70b": paper_profile, "h100_llama31_8b": h100_llama31_8b_profile}
"""The profiles `python -m simulator.profile` writes into `simulator/profiles/`."""


if __name__ == "__main__":
    for build in BUILDERS.values():
        prof = build()
        out = PROFILES / f"{prof.name}.json"
        out.write_text(json.dumps(prof.to_json(), indent=2) + "\n")
        print(out)
