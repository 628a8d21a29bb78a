"""Least squares for the time models: non-negative coefficients, anchored to a prior.

The prior (the model the conductor starts with) acts as `prior_weight` pseudo-observations,
so a handful of noisy timings nudges the model instead of replacing it, and features that
the observations do not exercise keep their prior value.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np


class Observations:
    """The last `capacity` (features, seconds) pairs: memory is bounded."""

    def __init__(self, capacity: int = 256) -> None:
        self._rows: deque[tuple[tuple[float, ...], float]] = deque(maxlen=capacity)
        self.added = 0

    def add(self, features: Sequence[float], seconds: float) -> None:
        self._rows.append((tuple(features), seconds))
        self.added += 1

    def __len__(self) -> int:
        return len(self._rows)

    def fit(self, prior: Sequence[float], prior_weight: float = 0.25) -> tuple[float, ...]:
        """Coefficients c >= 0 minimising the squared relative error of the observations plus
        `prior_weight` times the squared relative pull of each term away from the prior's.
        Solved for the deviation from the prior, so unexercised features keep the prior."""
        p = np.asarray(prior, dtype=float)
        if not self._rows:
            return tuple(float(c) for c in p)
        x = np.array([r[0] for r in self._rows], dtype=float)
        y = np.array([r[1] for r in self._rows], dtype=float)
        w = 1.0 / np.maximum(y, 1e-6)
        # a term's typical share of a timing: how strongly the prior holds it
        share = np.abs(x).mean(axis=0) / max(float(y.mean()), 1e-6)
        a = np.vstack([x * w[:, None], np.sqrt(prior_weight) * np.diag(share)])
        b = np.concatenate([(y - x @ p) * w, np.zeros(len(p))])
        dev, *_ = np.linalg.lstsq(a, b, rcond=None)
        return tuple(float(c) for c in np.maximum(p + dev, 0.0))
