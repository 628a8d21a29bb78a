"""Least squares for the time models: non-negative coefficients, anchored to a prior.

The prior (the model the conductor starts with) acts as `prior_weight` pseudo-observations,
so a handful of noisy timings nudges the model instead of replacing it, and features that
the observations do not exercise keep their prior value. Each term is also held to its prior
in relative terms (`RELATIVE_WEIGHT`): observations that exercise a term only a little can
otherwise move it by orders of magnitude: a few 2-token prefills (a step's fixed cost) can
set the attention term a thousand times its prior, and a model that predicts seconds for
prompts that take a fraction of one refuses every request (docs/design.md, "The time models
are held to their prior").

Observations age: each weighs half as much every `half_life_s`, so the model follows a machine
whose speed drifts and, without new timings, drifts back to the prior. That matters because a
model fitted to a slow moment makes the scheduler reject everything, and rejected requests
bring no timings to correct it: without forgetting, the conductor would refuse traffic for good.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

import numpy as np

HALF_LIFE_S = 60.0
RELATIVE_WEIGHT = 4e-4
"""The relative pull: a term moved by a factor f costs `RELATIVE_WEIGHT * (f - 1)**2`, one
observation's whole misfit at f ~ 50; a 1,000-fold move costs ~400 of them, while a 40-fold
slowdown of the machine (every term, every observation) remains a fit."""


Row = tuple[tuple[float, ...], float, float]
"""One observation as it travels between processes: (features, seconds, the wall-clock time it
was taken). The wall time names it: the same timing merged twice is kept once."""


class Observations:
    """The last `capacity` (features, seconds, when, wall time) rows: memory is bounded."""

    def __init__(self, capacity: int = 256, half_life_s: float = HALF_LIFE_S) -> None:
        self._rows: deque[tuple[tuple[float, ...], float, float, float]] = deque(maxlen=capacity)
        self.added = 0
        """Rows added here (`add`), not merged from elsewhere."""
        self.half_life_s = half_life_s

    def add(self, features: Sequence[float], seconds: float, at: float,
            wall: float | None = None) -> None:
        self._rows.append((tuple(features), seconds, at, time.time() if wall is None else wall))
        self.added += 1

    def __len__(self) -> int:
        return len(self._rows)

    def export(self) -> tuple[Row, ...]:
        """The rows, oldest first, as they travel (`Row`)."""
        return tuple((f, s, wall) for f, s, _, wall in self._rows)

    def merge(self, rows: Sequence[Row], now: float, wall_now: float) -> int:
        """Take `rows` (as `export` gives them) beside these: each row once, the newest
        `capacity` kept; a row's age is its wall-clock age (`wall_now - wall`) from `now` on.
        Returns how many rows are new here."""
        have = {(f, s, wall) for f, s, _, wall in self._rows}
        new = [(tuple(f), s, now - max(wall_now - wall, 0.0), wall) for f, s, wall in rows
               if (tuple(f), s, wall) not in have]
        if new:
            merged = sorted([*self._rows, *new], key=lambda r: r[3])
            self._rows = deque(merged[-self._rows.maxlen:] if self._rows.maxlen else merged,
                               maxlen=self._rows.maxlen)
        return len(new)

    def fit(self, prior: Sequence[float], now: float,
            prior_weight: float = 0.25) -> tuple[float, ...]:
        """Coefficients c >= 0 minimising the squared relative error of the observations, each
        weighted by its age at `now`, plus `prior_weight` times the squared relative pull of
        each term away from the prior's, plus `RELATIVE_WEIGHT` times its squared relative
        change. Solved for the deviation from the prior, so
        unexercised features keep the prior."""
        p = np.asarray(prior, dtype=float)
        if not self._rows:
            return tuple(float(c) for c in p)
        x = np.array([r[0] for r in self._rows], dtype=float)
        y = np.array([r[1] for r in self._rows], dtype=float)
        age = np.maximum(now - np.array([r[2] for r in self._rows], dtype=float), 0.0)
        w = np.sqrt(0.5 ** (age / self.half_life_s)) / np.maximum(y, 1e-6)
        # a term's typical share of a timing: how strongly the prior holds it
        share = np.abs(x).mean(axis=0) / max(float(y.mean()), 1e-6)
        relative = 1.0 / np.maximum(np.abs(p), 1e-12)
        a = np.vstack([x * w[:, None], np.sqrt(prior_weight) * np.diag(share),
                       np.sqrt(RELATIVE_WEIGHT) * np.diag(relative)])
        b = np.concatenate([(y - x @ p) * w, np.zeros(2 * len(p))])
        dev, *_ = np.linalg.lstsq(a, b, rcond=None)
        return tuple(float(c) for c in np.maximum(p + dev, 0.0))


class _Model(Protocol):
    def coefficients(self) -> tuple[float, ...]: ...


M = TypeVar("M", bound=_Model)

REFRESH_S = 5.0


class Fitter(Generic[M]):
    """A time model refitted from its observations: every `every` of them (at once for the
    first two) and, as they age, at least every `REFRESH_S` through `refresh`."""

    def __init__(self, prior: M, make: Callable[..., M], capacity: int = 256,
                 every: int = 4) -> None:
        self.prior = prior
        self.model = prior
        self._make = make
        self._obs = Observations(capacity)
        self._every = every
        self._fitted_at = 0.0

    @property
    def observations(self) -> int:
        """Observations made here (`add`), not merged from elsewhere."""
        return self._obs.added

    @property
    def fitted_at(self) -> float:
        """When the model was last fitted (the clock `now` is given in)."""
        return self._fitted_at

    def rows(self) -> tuple[Row, ...]:
        """What the model is fitted from, as it travels (`Observations.export`)."""
        return self._obs.export()

    def add(self, features: Sequence[float], seconds: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._obs.add(features, seconds, now)
        if self._obs.added % self._every == 0 or self._obs.added <= 2:
            self._refit(now)

    def adopt(self, model: M, rows: Sequence[Row], now: float, wall_now: float,
              fitted_wall: float | None = None) -> bool:
        """Take another fitter's model and rows (another process's, or this one's before a
        restart), `model` fitted at wall-clock time `fitted_wall` (None: now). Rows new here
        are merged; when the rows are then exactly `rows`, `model` is taken as it is, as
        fitted then (`refresh` refits it once it is `REFRESH_S` old, as its own fitter
        would), else the model is refitted from all of them now. False when nothing was
        new."""
        if not self._obs.merge(rows, now, wall_now):
            return False
        if set(self._obs.export()) == {(tuple(f), s, w) for f, s, w in rows}:
            age = 0.0 if fitted_wall is None else max(wall_now - fitted_wall, 0.0)
            self.model, self._fitted_at = model, now - age
        else:
            self._refit(now)
        return True

    def refresh(self, now: float) -> None:
        """Refit for the observations' ages (a model nothing new confirms returns to the prior)."""
        if len(self._obs) and now - self._fitted_at >= REFRESH_S:
            self._refit(now)

    def _refit(self, now: float) -> None:
        self.model = self._make(*self._obs.fit(self.prior.coefficients(), now))
        self._fitted_at = now
