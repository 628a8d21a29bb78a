"""Tests of the tiny locally trained Llama model (transformers only, no vLLM).

The default model is built into the shared cache on first use (about a minute on 2 cores),
then reused; the determinism and cache tests use a much smaller spec in a tmp dir.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tinymodel import builder
from tinymodel.builder import ModelSpec, ensure_model

TINY = ModelSpec(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=32,
    max_position_embeddings=256,
    train_steps=4,
    batch_size=2,
    seq_len=32,
    corpus_docs=300,
)

PROMPT_PAIRS = [
    ("The capital of France is", "Count: 1, 2, 3,"),
    ("Hello, my name is", "name: Alice\nage:"),
    ("The days are Monday,", "user: Hi!\nassistant:"),
]
# Shares its last 47 tokens (more than one 32-token KV block) between the two prompts below.
FILLER = (
    " It was a cold morning. Nothing happened for three days. The road was long and quiet."
    " Rain fell all night. Far away, a bell rang five times. Time passed slowly. The clouds"
    " were dark that day. Everyone loved the"
)


@pytest.fixture(scope="module")
def default_model() -> tuple[Path, object, object]:
    path = ensure_model()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    return path, tok, model


def _greedy(tok: object, model: object, prompt: str, n: int = 8) -> tuple[list[int], list[float]]:
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=n,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=tok.pad_token_id,
        )
    new = out.sequences[0, ids.shape[1] :].tolist()
    top1 = [torch.softmax(s[0].float(), -1).max().item() for s in out.scores]
    return new, top1


def test_spec_validation() -> None:
    with pytest.raises(ValueError):
        ModelSpec(head_dim=48)
    with pytest.raises(ValueError):
        ModelSpec(num_heads=4, num_kv_heads=3)
    assert ModelSpec().cache_key() == ModelSpec().cache_key()
    assert ModelSpec(seed=1).dir_name() != ModelSpec().dir_name()


def test_corpus_is_deterministic() -> None:
    assert builder.generate_corpus(50, 3) == builder.generate_corpus(50, 3)
    assert builder.generate_corpus(50, 3) != builder.generate_corpus(50, 4)


def test_same_spec_same_weights(tmp_path: Path) -> None:
    a = ensure_model(TINY, tmp_path / "a")
    b = ensure_model(TINY, tmp_path / "b")
    assert a.name == b.name
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_cache_reuse_and_no_leftovers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = ensure_model(TINY, tmp_path)
    assert builder.is_complete(path)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == [path.name]

    def no_rebuild(*_: object) -> None:
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(builder, "_build", no_rebuild)
    t0 = time.monotonic()
    assert ensure_model(TINY, tmp_path) == path
    assert time.monotonic() - t0 < 1.0


def test_env_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCLUSTER_CACHE_DIR", str(tmp_path / "env"))
    assert builder.default_cache_dir() == tmp_path / "env"
    assert ensure_model(TINY).parent == tmp_path / "env"


def test_concurrent_callers_build_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real_build = builder._build

    def counting_build(spec: ModelSpec, out: Path) -> None:
        calls.append(out)
        time.sleep(0.2)  # widen the race window
        real_build(spec, out)

    monkeypatch.setattr(builder, "_build", counting_build)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_model(TINY, tmp_path)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert len(results) == 3 and len(set(results)) == 1


def test_failed_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_build(spec: ModelSpec, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("boom")

    monkeypatch.setattr(builder, "_build", failing_build)
    with pytest.raises(RuntimeError):
        ensure_model(TINY, tmp_path)
    assert [p for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_build_restores_caller_torch_state(tmp_path: Path) -> None:
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    threads = torch.get_num_threads()
    ensure_model(dataclasses.replace(TINY, seed=7), tmp_path)
    assert torch.get_num_threads() == threads
    assert torch.equal(torch.rand(3), expected)


def test_tokenizer_roundtrip_and_chat_template(default_model: tuple) -> None:
    path, tok, _ = default_model
    assert len(tok) == ModelSpec().vocab_size
    text = "The capital of France is Paris. Count: 1, 2, 3.\nname: Zed ü €"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert "chat_template" in (path / "tokenizer_config.json").read_text()
    msgs = [{"role": "user", "content": "What is the capital of Japan?"}]
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert rendered == "<|bos|>user: What is the capital of Japan?\nassistant:"


def test_default_model_is_prompt_dependent_and_confident(default_model: tuple) -> None:
    _, tok, model = default_model
    vocab = model.config.vocab_size
    all_top1: list[float] = []
    for a, b in PROMPT_PAIRS:
        toks_a, top1_a = _greedy(tok, model, a)
        toks_b, top1_b = _greedy(tok, model, b)
        assert toks_a != toks_b, (a, b, tok.decode(toks_a))
        all_top1 += top1_a + top1_b
    mean_top1 = sum(all_top1) / len(all_top1)
    assert mean_top1 > 0.2, mean_top1
    assert mean_top1 > 100 / vocab
    assert math.isfinite(mean_top1)


def test_default_model_depends_on_the_first_kv_block(default_model: tuple) -> None:
    """Only the opening sentence differs. With the default 320 steps the greedy token may be
    the same, but the next-token log-probs differ far beyond fp32 kernel noise (~1e-5): a KV
    test comparing log-probs catches a wrong early block, one comparing tokens may not."""
    _, tok, model = default_model

    def logprobs(prompt: str) -> torch.Tensor:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            return torch.log_softmax(model(ids).logits[0, -1].float(), -1)

    assert len(tok(FILLER, add_special_tokens=False).input_ids) > 32
    a = logprobs("This is a story about a fox." + FILLER)
    b = logprobs("Alice saw a small horse in the garden." + FILLER)
    assert (a - b).abs().max().item() > 0.01


def test_default_model_chat_answer(default_model: tuple) -> None:
    _, tok, model = default_model
    msgs = [{"role": "user", "content": "Hello!"}]
    ids = tok.apply_chat_template(
        msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    assert "help" in tok.decode(out[0, ids.shape[1] :])
