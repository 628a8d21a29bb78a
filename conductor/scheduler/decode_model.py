"""Time between tokens on a decode instance, as a function of its batch and KV in use.

`tbt(n, k) = base + per_seq * n + per_kv_token * k` for `n` running requests holding `k` KV
tokens: a step's fixed cost, the per-sequence work, and attention reading the KV. Refitted
from the inter-token times the conductor sees on decode streams (one observation per request:
its mean TBT, mean batch and mean KV).
"""

from __future__ import annotations

from dataclasses import dataclass

from conductor.scheduler.regression import Fitter


@dataclass(frozen=True)
class TbtModel:
    base_s: float = 0.01
    per_seq_s: float = 1e-3
    per_kv_token_s: float = 1e-7

    def predict(self, running: int, kv_tokens: int) -> float:
        return self.base_s + self.per_seq_s * running + self.per_kv_token_s * kv_tokens

    def coefficients(self) -> tuple[float, float, float]:
        return (self.base_s, self.per_seq_s, self.per_kv_token_s)


class TbtFitter(Fitter[TbtModel]):
    def __init__(self, prior: TbtModel | None = None, capacity: int = 256, every: int = 4) -> None:
        super().__init__(prior or TbtModel(), TbtModel, capacity, every)

    def observe(self, running: float, kv_tokens: float, tbt_s: float,
                now: float | None = None) -> None:
        if running <= 0 or tbt_s <= 0:
            return
        self.add((1.0, float(running), float(kv_tokens)), tbt_s, now)
