"""How long a prefill takes: a model fitted to the prefill timings the workers report.

`t(u, c) = base + per_token * u + per_attn * u * (c + u / 2)` for `u` computed (uncached)
tokens after a cached prefix of `c` tokens: a fixed step cost, the linear layers, and the
attention of every new token to everything before it. Mooncake fits such a model offline;
here it starts from a prior and is refitted online from `PrefillReply.engine_seconds`.
One model serves every instance; what sets an instance apart (its cores, its load) is its
speed, a factor on this model's times (`conductor.scheduler.load.LoadState.observe_prefill`),
and the model learns each timing divided by it.
"""

from __future__ import annotations

from dataclasses import dataclass

from conductor.scheduler.regression import Fitter


@dataclass(frozen=True)
class PrefillTimeModel:
    base_s: float = 0.01
    per_token_s: float = 1e-4
    per_attn_s: float = 1e-8

    def predict(self, uncached: int, cached: int) -> float:
        """Seconds to compute `uncached` tokens after `cached` tokens of prefix."""
        attn = self.per_attn_s * (cached + uncached / 2)
        return self.base_s + uncached * (self.per_token_s + attn)

    def coefficients(self) -> tuple[float, float, float]:
        return (self.base_s, self.per_token_s, self.per_attn_s)


def features(uncached: int, cached: int) -> tuple[float, float, float]:
    return (1.0, float(uncached), uncached * (cached + uncached / 2))


INTER_DEPARTURE_BAND = (0.25, 4.0)
"""An inter-departure time (a prefill that did not run alone) counts as a service time only
within this factor of the current prediction: batched completions make one arbitrarily short,
and a prompt whose few uncached tokens waited behind another's chunks on an engine that
prefills several at once arbitrarily long (a short remainder timed at the seconds it waited
would teach the model a minute for a cached prompt: docs/design.md, "The time models are held
to their prior")."""


def plausible(seconds: float, predicted: float) -> bool:
    """Whether an inter-departure time of `seconds` may stand for a service time."""
    return INTER_DEPARTURE_BAND[0] * predicted <= seconds <= INTER_DEPARTURE_BAND[1] * predicted


class PrefillTimeFitter(Fitter[PrefillTimeModel]):
    """Collects (uncached, cached, seconds) observations (see `Fitter`)."""

    def __init__(self, prior: PrefillTimeModel | None = None, capacity: int = 256,
                 every: int = 4) -> None:
        super().__init__(prior or PrefillTimeModel(), PrefillTimeModel, capacity, every)

    def observe(self, uncached: int, cached: int, seconds: float, exact: bool = True,
                now: float | None = None) -> None:
        """One timing; `exact=False` for an inter-departure estimate, dropped unless
        `plausible`."""
        if uncached <= 0 or seconds <= 0:
            return
        if not exact and not plausible(seconds, self.model.predict(uncached, cached)):
            return
        self.add(features(uncached, cached), seconds, now)
