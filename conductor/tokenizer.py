"""The conductor tokenizes once, with the model's own tokenizer, as vLLM's server does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conductor.errors import InvalidRequest


class Tokenizer:
    def __init__(self, model_dir: str, max_model_len: int = 0) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(model_dir)
        # The Rust tokenizer directly: the same ids at half the cost of the Python wrapper.
        self._fast = self._tok.backend_tokenizer if getattr(self._tok, "is_fast", False) else None
        self.vocab_size = len(self._tok)
        cfg = json.loads(Path(model_dir, "config.json").read_text())
        self.model_max_len = max_model_len or int(cfg.get("max_position_embeddings", 2048))
        self.max_model_len = self.model_max_len
        """The context requests are checked against: the smallest the workers announce
        (`serve_within`), else the model's own."""
        self.max_chars_per_token = max((len(t) for t in self._tok.get_vocab()), default=1)

    @property
    def hf(self) -> Any:
        """The Hugging Face tokenizer (for its chat template)."""
        return self._tok

    def encode_prompt(self, prompt: object, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a completion prompt (text, or token ids), checked against the context."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("prompt must not be empty", param="prompt")
            return self.encode_text(prompt, add_special_tokens)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return self.check_ids(list(prompt))
        if isinstance(prompt, list) and len(prompt) == 1:
            return self.encode_prompt(prompt[0], add_special_tokens)
        if isinstance(prompt, list) and not prompt:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        raise InvalidRequest("batched prompts are not supported: send one prompt per request",
                             param="prompt")

    def encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        # vLLM's cheap guard: a text this long cannot fit, whatever it tokenizes to.
        if len(text) > self.max_model_len * self.max_chars_per_token:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt contains {len(text)} characters (more than "
                f"{self.max_model_len * self.max_chars_per_token} characters, which is the upper "
                f"bound for {self.max_model_len} input tokens). Please reduce the length of the "
                "input prompt.", param="input_text")
        if self._fast is not None:
            ids = self._fast.encode(text, add_special_tokens=add_special_tokens).ids
        else:
            ids = self._tok(text, add_special_tokens=add_special_tokens)["input_ids"]
        return self._check_length(list(ids))

    def check_ids(self, ids: list[int]) -> list[int]:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"Token id {bad[0]} is out of vocabulary (size "
                                 f"{self.vocab_size})", param="prompt")
        return self._check_length(ids)

    def _check_length(self, ids: list[int]) -> list[int]:
        if not ids:
            raise InvalidRequest("The prompt is empty after tokenization.", param="prompt")
        if len(ids) >= self.max_model_len:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt contains {len(ids)} input tokens, which leaves no room for any "
                "output tokens. Please reduce the length of the input prompt.",
                param="input_tokens")
        return ids

    def serve_within(self, engine_lens: list[int]) -> None:
        """The engines' contexts (0: unknown): a request must fit any engine it may reach."""
        known = [n for n in engine_lens if n > 0]
        self.max_model_len = min(known) if known else self.model_max_len

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    def clamp_max_tokens(self, prompt_len: int, max_tokens: int | None) -> int:
        """max_tokens lowered to fit the context (vLLM's behaviour), never rejected for it."""
        room = self.max_model_len - prompt_len
        return room if max_tokens is None else min(max_tokens, room)
