"""Pool key namespaces: engines share blocks only when their KV for the same tokens is the
same bytes (store/namespace.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from store import namespace
from store.namespace import kv_namespace, weights_digest


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _model(root: Path, name: str, weights: bytes) -> str:
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2}))
    (d / "model.safetensors").write_bytes(weights)
    return str(d)


def test_two_fine_tunes_with_one_config_share_no_block(tmp_path):
    base = _model(tmp_path, "base", b"\x00" * 4096)
    tuned = _model(tmp_path, "tuned", b"\x00" * 4095 + b"\x01")
    copy = _model(tmp_path, "copy", b"\x00" * 4096)
    assert kv_namespace(base, 16, "float32") != kv_namespace(tuned, 16, "float32")
    assert kv_namespace(base, 16, "float32") == kv_namespace(copy, 16, "float32")


def test_the_layout_and_the_engine_are_in_the_namespace(tmp_path):
    m = _model(tmp_path, "m", b"w" * 100)
    ns = {kv_namespace(m, 16, "float32", "vllm 1|"), kv_namespace(m, 32, "float32", "vllm 1|"),
          kv_namespace(m, 16, "bfloat16", "vllm 1|"), kv_namespace(m, 16, "float32", "vllm 2|"),
          kv_namespace(m, 16, "float32", "vllm 1|FLASHINFER")}
    assert len(ns) == 5 and all(n.startswith("kv-") and "/" not in n for n in ns)
    assert "|" in namespace.engine_identity()


def test_the_weights_digest_is_computed_once_per_file_version(tmp_path, monkeypatch):
    m = _model(tmp_path, "m", b"a" * 1000)
    first = weights_digest(m)
    assert first and namespace.cache_file().exists()
    reads: list[Path] = []
    real_open = Path.open
    monkeypatch.setattr(Path, "open", lambda self, *a, **k: (
        reads.append(self) if self.suffix == ".safetensors" else None) or
        real_open(self, *a, **k))
    assert weights_digest(m) == first and not reads  # from the cache
    weights = Path(m, "model.safetensors")
    weights.write_bytes(b"b" * 1000)  # same size: the modification time tells
    os.utime(weights, ns=(1, 1))
    assert weights_digest(m) != first and reads


def test_a_model_name_without_weights_still_gets_a_namespace(tmp_path):
    assert weights_digest(str(tmp_path / "absent")) == ""
    assert kv_namespace("org/some-model", 16, "float16").startswith("kv-")
