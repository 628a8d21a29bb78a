"""`worker.dtype`: "auto" resolved as vLLM resolves it, before the engine starts."""

from __future__ import annotations

import json

import pytest

from worker.dtype import checkpoint_dtype, resolve

CPU = ["bfloat16", "float16", "float32"]


def _checkpoint(tmp_path, **conf) -> str:
    (tmp_path / "config.json").write_text(json.dumps(conf))
    return str(tmp_path)


def test_a_float32_checkpoint_runs_in_the_platforms_preferred_type(tmp_path):
    model = _checkpoint(tmp_path, torch_dtype="float32")
    assert resolve(model, "auto", CPU) == "bfloat16"
    assert resolve(model, "auto", ["float16", "float32"]) == "float16"


def test_a_16_bit_checkpoint_keeps_its_type_where_supported(tmp_path):
    model = _checkpoint(tmp_path, dtype="float16")  # newer transformers write "dtype"
    assert checkpoint_dtype(model) == "float16"
    assert resolve(model, "auto", CPU) == "float16"
    assert resolve(_checkpoint(tmp_path, torch_dtype="bfloat16"), "auto",
                   ["float16", "float32"]) == "float16"


def test_no_config_or_no_dtype_named_is_the_preferred_type(tmp_path):
    assert resolve(str(tmp_path / "absent"), "auto", CPU) == "bfloat16"
    assert resolve(_checkpoint(tmp_path), "auto", CPU) == "bfloat16"


def test_an_explicit_dtype_is_kept_and_a_wrong_one_refused(tmp_path):
    model = _checkpoint(tmp_path, torch_dtype="float32")
    assert resolve(model, "float32", CPU) == "float32"
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve(model, "fp8", CPU)


def test_the_rule_is_vllms_on_this_platform(model_dir):
    """What the namespace is keyed on is what vLLM itself picks for "auto"."""
    from transformers import AutoConfig
    from vllm.config.model import _get_and_verify_dtype

    want = _get_and_verify_dtype(model_dir, AutoConfig.from_pretrained(model_dir), "auto",
                                 is_pooling_model=False)
    assert resolve(model_dir, "auto") == str(want).removeprefix("torch.")
