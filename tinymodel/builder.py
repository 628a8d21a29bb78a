"""Build (once) and cache a tiny Llama checkpoint that vLLM can serve, without any download.

The model is trained from scratch on a synthetic, deterministically generated corpus so that
its outputs depend on the prompt and its next-token distribution is peaked (mean top-1
probability ~0.5 with a 2048-token vocabulary), which makes it a usable oracle for KV-cache
transfer tests. Surprise: with the default ~1 minute of training its *greedy tokens* depend
mostly on the last few dozen prompt tokens; a different early KV block shifts the log-probs
(by ~0.1-0.5 nats, far above fp32 kernel noise) but rarely flips a greedy token. KV tests
should therefore compare log-probs, not only tokens. Long-range recall (see
``tinymodel.corpus._doc_focus``) emerges only at ~1000 train steps (``--steps 1000``, ~4
minutes on 2 cores).

Contract of :func:`ensure_model`: the returned directory is complete (config, safetensors
weights, tokenizer, marker file) and never modified afterwards. Its name is a hash of the
:class:`ModelSpec` and :data:`BUILDER_VERSION`; bump the version whenever the corpus, the
tokenizer or the training recipe changes, so stale caches are not reused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tinymodel.corpus import generate_corpus

if TYPE_CHECKING:
    from tokenizers import Tokenizer

BUILDER_VERSION = "2"

MARKER_FILE = "kvcluster_model.json"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"

# Rendered with transformers' Jinja sandbox. The dialog documents of the training corpus use
# exactly this format, so chat prompts are in-distribution. The BOS comes from the template:
# chat prompts are tokenized with add_special_tokens=False.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

VLLM_HEAD_DIMS = (32, 64, 80, 96, 112, 128)


@dataclass(frozen=True)
class ModelSpec:
    """Architecture and training recipe of the tiny model; every field feeds the cache key."""

    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 704
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 2048
    train_steps: int = 320
    batch_size: int = 8
    seq_len: int = 128
    learning_rate: float = 1.5e-3
    corpus_docs: int = 6000
    seed: int = 0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.head_dim not in VLLM_HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {VLLM_HEAD_DIMS} (vLLM-CPU kernels)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        if self.vocab_size < 512:
            raise ValueError("vocab_size must be >= 512 (256 byte symbols + merges + specials)")
        if self.seq_len > self.max_position_embeddings:
            raise ValueError("seq_len must not exceed max_position_embeddings")

    def cache_key(self) -> str:
        """Stable hex digest of the spec and BUILDER_VERSION."""
        payload = json.dumps(
            {"builder_version": BUILDER_VERSION, **dataclasses.asdict(self)}, sort_keys=True
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def dir_name(self) -> str:
        return f"tinyllama-h{self.hidden_size}-l{self.num_layers}-{self.cache_key()}"


def default_cache_dir() -> Path:
    """``$KVCLUSTER_CACHE_DIR`` if set, else ``~/.cache/kvcluster/models``."""
    env = os.environ.get("KVCLUSTER_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvcluster" / "models"


def is_complete(model_dir: Path) -> bool:
    """True if ``model_dir`` holds a finished build (the marker is written last)."""
    return all(
        (model_dir / name).is_file()
        for name in (MARKER_FILE, "config.json", "model.safetensors", "tokenizer.json")
    )


def ensure_model(spec: ModelSpec = ModelSpec(), cache_dir: Path | None = None) -> Path:
    """Return the directory of the model built from ``spec``, building it if needed.

    Safe for concurrent callers (threads or processes): builders serialize on an fcntl lock
    next to the model directory, build into a temporary directory and publish it with an
    atomic rename, so a half-built directory is never returned. Building changes no global
    state of the caller (torch thread count and RNG states are restored).
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / spec.dir_name()
    if is_complete(target):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache_dir / f".{spec.dir_name()}.lock"):
        if is_complete(target):
            return target
        if target.exists():  # not produced by us (rename is atomic): stale, replace it
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{spec.dir_name()}.tmp-", dir=cache_dir))
        try:
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
            _build(spec, tmp)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _log(msg: str) -> None:
    print(f"[tinymodel] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------------


def _train_tokenizer(docs: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE; the post-processor prepends <bos>, as Llama tokenizers do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tok


def _save_tokenizer(tok: Tokenizer, spec: ModelSpec, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=spec.max_position_embeddings,
    )
    hf_tok.save_pretrained(out, save_jinja_files=False)
    # transformers 5 writes tokenizer_class "TokenizersBackend", unknown to transformers 4.x;
    # the classic name loads in both. The chat template stays inside tokenizer_config.json.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["add_bos_token"] = True
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def _isolated_torch(seed: int, threads: int = 2) -> Iterator[None]:
    """Seed torch/random/numpy and cap threads; restore the caller's state afterwards."""
    import numpy as np
    import torch

    saved = (
        random.getstate(),
        np.random.get_state(),
        torch.get_rng_state(),
        torch.get_num_threads(),
        torch.are_deterministic_algorithms_enabled(),
    )
    try:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        torch.set_num_threads(max(1, min(threads, os.cpu_count() or 1)))
        torch.use_deterministic_algorithms(True)
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])
        torch.set_num_threads(saved[3])
        torch.use_deterministic_algorithms(saved[4])


def _build(spec: ModelSpec, out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    t0 = time.monotonic()
    _log(f"building {spec.dir_name()} into {out.parent}")
    docs = generate_corpus(spec.corpus_docs, spec.seed)
    tok = _train_tokenizer(docs, spec.vocab_size)
    _log(
        f"corpus {len(docs)} docs, {sum(map(len, docs))} chars; tokenizer trained "
        f"({time.monotonic() - t0:.1f}s)"
    )
    _save_tokenizer(tok, spec, out)
    bos_id, eos_id, pad_id = (tok.token_to_id(t) for t in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN))

    # Documents are packed into one stream as "<bos> doc <eos>", like the serving prompts
    # (the tokenizer prepends <bos>); training windows are sampled at random offsets.
    stream: list[int] = []
    for enc in tok.encode_batch(docs):
        stream.extend(enc.ids)  # the post-processor already put <bos> first
        stream.append(eos_id)
    data = torch.tensor(stream, dtype=torch.long)

    # BPE may stop short of vocab_size on a small corpus; the embedding keeps the spec's size.
    if tok.get_vocab_size() > spec.vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} > {spec.vocab_size} tokens")
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        dtype=spec.dtype,
    )

    with _isolated_torch(spec.seed):
        model = LlamaForCausalLM(config).float()
        model.train()
        n_params = sum(p.numel() for p in model.parameters())
        _log(
            f"{n_params / 1e6:.2f}M params, {len(stream)} training tokens; "
            f"{spec.train_steps} steps of {spec.batch_size}x{spec.seq_len}"
        )
        opt = torch.optim.AdamW(
            model.parameters(), lr=spec.learning_rate, betas=(0.9, 0.95), weight_decay=0.01
        )
        warmup = max(1, spec.train_steps // 15)

        def lr_at(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = (step - warmup) / max(1, spec.train_steps - warmup)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
        gen = torch.Generator().manual_seed(spec.seed)
        offsets_span = len(stream) - spec.seq_len - 1
        log_every = max(1, spec.train_steps // 10)
        loss_val = float("nan")
        for step in range(spec.train_steps):
            starts = torch.randint(0, offsets_span, (spec.batch_size,), generator=gen)
            idx = starts[:, None] + torch.arange(spec.seq_len + 1)[None, :]
            batch = data[idx]
            logits = model(input_ids=batch[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            loss_val = loss.item()
            if (step + 1) % log_every == 0 or step == 0:
                _log(
                    f"step {step + 1}/{spec.train_steps} loss {loss_val:.3f} "
                    f"({time.monotonic() - t0:.1f}s)"
                )

        model.eval()
        model = model.to(getattr(torch, spec.dtype))
        model.generation_config.bos_token_id = bos_id
        model.generation_config.eos_token_id = eos_id
        model.generation_config.pad_token_id = pad_id
        model.save_pretrained(out)

    for f in out.iterdir():
        f.chmod(0o644)  # safetensors leaves 0600
    elapsed = time.monotonic() - t0
    marker = {
        "builder_version": BUILDER_VERSION,
        "spec": dataclasses.asdict(spec),
        "final_loss": round(loss_val, 4),
        "build_seconds": round(elapsed, 1),
    }
    # Written last: its presence is what makes the directory complete.
    (out / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    _log(f"done: final loss {loss_val:.3f} in {elapsed:.1f}s")
