"""The engines' dtype: "auto" (the default, as in `vllm serve`) resolved before an engine
starts, so that the pool namespace (`store.namespace`) names the bytes the engine will write
and every engine of a cluster, ours or a benchmark's `vllm serve`, computes in the same one.

The rule is vLLM's for "auto" (`vllm.config.model._resolve_auto_dtype`): a float32
checkpoint, or one that names no dtype, runs in the platform's preferred type (bfloat16 on an
x86 CPU with AVX-512 or AMX, and on a GPU that has it); a 16-bit checkpoint in its own type
where the platform supports it. Run in float32 instead, a CPU engine with bfloat16 support
steps more than twice as slowly as a plain `vllm serve` of the same checkpoint started with its
defaults (docs/design.md, "The engines compute in the dtype `vllm serve` picks")."""

from __future__ import annotations

import json
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")


def checkpoint_dtype(model: str) -> str:
    """The dtype the checkpoint's config.json names ("" for none or no such file)."""
    cfg = Path(model, "config.json")
    try:
        conf = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return ""
    named = conf.get("torch_dtype") or conf.get("dtype") or ""
    return named if isinstance(named, str) else ""


def resolve(model: str, dtype: str, supported: list[str] | None = None) -> str:
    """`dtype`, or for "auto" the type vLLM would pick for `model` on this platform;
    `supported`: the platform's types, preferred first (default: vLLM's `current_platform`)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if dtype != "auto":
        return dtype
    if supported is None:
        from vllm.platforms import current_platform

        supported = [str(d).removeprefix("torch.") for d in current_platform.supported_dtypes]
    stored = checkpoint_dtype(model)
    if stored and stored != "float32" and stored in supported:
        return stored
    return supported[0]
