"""Time between tokens on a decode instance, as a function of its batch and KV in use.

`tbt(n, k) = base + per_seq * n + per_kv_token * k` for `n` running requests holding `k` KV
tokens: a step's fixed cost, the per-sequence work, and attention reading the KV. Refitted
from the inter-token times the conductor sees on decode streams (one observation per request:
its mean TBT, mean batch and mean KV).
"""

from __future__ import annotations

from dataclasses import dataclass

from conductor.scheduler.regression import Observations


@dataclass(frozen=True)
class TbtModel:
    base_s: float = 0.01
    per_seq_s: float = 1e-3
    per_kv_token_s: float = 1e-7

    def predict(self, running: int, kv_tokens: int) -> float:
        return self.base_s + self.per_seq_s * running + self.per_kv_token_s * kv_tokens

    def coefficients(self) -> tuple[float, float, float]:
        return (self.base_s, self.per_seq_s, self.per_kv_token_s)


class TbtFitter:
    def __init__(self, prior: TbtModel | None = None, capacity: int = 256, every: int = 4) -> None:
        self.prior = prior or TbtModel()
        self.model = self.prior
        self._obs = Observations(capacity)
        self._every = every

    def observe(self, running: float, kv_tokens: float, tbt_s: float) -> None:
        if running <= 0 or tbt_s <= 0:
            return
        self._obs.add((1.0, float(running), float(kv_tokens)), tbt_s)
        if self._obs.added % self._every == 0 or self._obs.added <= 2:
            self.model = TbtModel(*self._obs.fit(self.prior.coefficients()))

    @property
    def observations(self) -> int:
        return self._obs.added
