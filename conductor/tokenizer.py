"""The conductor tokenizes once, with the model's own tokenizer, as vLLM's server does."""

from __future__ import annotations

import json
from pathlib import Path

from conductor.errors import InvalidRequest


class Tokenizer:
    def __init__(self, model_dir: str, max_model_len: int = 0) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(model_dir)
        self.vocab_size = len(self._tok)
        cfg = json.loads(Path(model_dir, "config.json").read_text())
        self.max_model_len = max_model_len or int(cfg.get("max_position_embeddings", 2048))

    def encode_prompt(self, prompt: object) -> list[int]:
        """Token ids of a completion prompt (text, or token ids), checked against the context."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("prompt must not be empty", param="prompt")
            ids = list(self._tok(prompt, add_special_tokens=True)["input_ids"])
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequest(f"token id {bad[0]} is out of vocabulary "
                                     f"(size {self.vocab_size})", param="prompt")
        elif isinstance(prompt, list) and len(prompt) == 1:
            return self.encode_prompt(prompt[0])
        elif isinstance(prompt, list) and not prompt:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        else:
            raise InvalidRequest("batched prompts are not supported: send one prompt per request",
                                 param="prompt")
        if len(ids) >= self.max_model_len:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your request has {len(ids)} input tokens. Please reduce the length of the "
                "input messages.", param="prompt")
        return ids

    def clamp_max_tokens(self, prompt_len: int, max_tokens: int | None) -> int:
        """max_tokens lowered to fit the context (vLLM's behaviour), never rejected for it."""
        room = self.max_model_len - prompt_len
        return room if max_tokens is None else min(max_tokens, room)
