"""One instance's load, counted by the conductor at dispatch time (not polled afterwards).

Prefill side: the prefills dispatched and not finished, as a FIFO of predicted compute times.
The queue is predicted to drain at `busy_until = head_started + sum(predicted times)`, where
`head_started` is when the current head began (its dispatch to an idle instance, or the
previous completion); every completion re-anchors it, so the prediction corrects itself.

Decode side: the requests dispatched to it (counted from dispatch, before their prefill ends,
so prefill and decode load do not oscillate out of phase), the KV tokens they hold, and
when each is predicted to finish.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from conductor.scheduler.prefill_model import PrefillTimeModel
from conductor.scheduler.snapshot import InstanceLoad, beside_speed

SPEED_WINDOW = 8
SPEED_RANGE = (0.2, 10.0)


@dataclass
class _Decode:
    prompt_tokens: int
    generated: int
    finish_at: float
    sequences: int = 1


class LoadState:
    def __init__(self, instance_id: str, role: str, block_size: int,
                 kv_capacity_tokens: int = 0, max_seqs: int = 0) -> None:
        self.instance_id = instance_id
        self.role = role
        self.block_size = block_size
        self.kv_capacity_tokens = kv_capacity_tokens
        self.max_seqs = max_seqs
        self._prefills: dict[str, tuple[float, int, int]] = {}
        """request id -> (predicted seconds, prompt tokens, uncached tokens)"""
        self._work_s = 0.0
        self._head_started = 0.0
        self._decodes: dict[str, _Decode] = {}
        self.kv_tokens = 0
        self.queued_prompt_tokens = 0
        self.queued_uncached_tokens = 0
        self.dispatched_total = 0
        self._finishes: list[float] = []
        """the decoding sequences' finish_at, ascending (a request's once per sequence)"""
        self._both = 0
        """requests counted in both `_prefills` and `_decodes` (prefill and decode here)"""
        self._unseen = 0
        """tokens generated since the view was last invalidated"""
        self._view: InstanceLoad | None = None
        self.host = ""
        self.cores: frozenset[int] = frozenset()
        self.threads = 0
        self.side = False
        self.gpus: frozenset[int] = frozenset()
        """Where it computes (`snapshot.contention`), from its registration."""
        self.prefill_speed = 1.0
        """Its prefill times over the fitted model's predictions, averaged (`observe_prefill`)."""
        self.prefill_speed_beside: float | None = None
        """The same for prefills beside streams of its own (None: none timed yet)."""
        self._timings: dict[bool, deque[tuple[int, int, float]]] = {
            beside: deque(maxlen=SPEED_WINDOW) for beside in (False, True)}
        """Its last prefills that count towards its speeds, without and with streams of its
        own beside them: (uncached, cached, seconds)."""
        self.on_change: Callable[[str], None] | None = None
        """Told the instance id whenever the load changes (the registry's snapshot upkeep)."""

    def _changed(self) -> None:
        self._view = None
        self._unseen = 0
        if self.on_change is not None:
            self.on_change(self.instance_id)

    def set_role(self, role: str) -> None:
        """Route it as another role (an instance registered as "both" was switched)."""
        self.role = role
        self._changed()

    # ------------------------------------------------------------------ prefill

    def add_prefill(self, request_id: str, prompt_tokens: int, uncached_tokens: int,
                    predicted_s: float, now: float) -> None:
        if not self._prefills:
            self._head_started = now
            self._work_s = 0.0
        self._prefills[request_id] = (predicted_s, prompt_tokens, uncached_tokens)
        self._both += request_id in self._decodes
        self._work_s += predicted_s
        self.queued_prompt_tokens += prompt_tokens
        self.queued_uncached_tokens += uncached_tokens
        self.dispatched_total += 1
        self._changed()

    def end_prefill(self, request_id: str, now: float) -> None:
        entry = self._prefills.pop(request_id, None)
        if entry is None:
            return
        predicted_s, prompt_tokens, uncached_tokens = entry
        self._both -= request_id in self._decodes
        self._work_s = max(self._work_s - predicted_s, 0.0) if self._prefills else 0.0
        self._head_started = now
        self.queued_prompt_tokens -= prompt_tokens
        self.queued_uncached_tokens -= uncached_tokens
        self._changed()

    def service_time(self, now: float) -> float:
        """Seconds since the queue's head started (its dispatch to an idle instance, or the
        previous completion): the service time of the request completing now."""
        return now - self._head_started

    def speed(self, beside: bool) -> float:
        """Its prefill speed with (`beside`) or without streams of its own decoding."""
        return beside_speed(self.prefill_speed, self.prefill_speed_beside) if beside \
            else self.prefill_speed

    def observe_prefill(self, uncached: int, cached: int, seconds: float,
                        model: PrefillTimeModel, beside: bool = False) -> None:
        """A prefill of this instance computed `uncached` tokens after `cached` in `seconds`,
        with streams of its own decoding (`beside`) or not: that speed becomes its last
        `SPEED_WINDOW` such timings' mean ratio to `model`."""
        if seconds <= 0 or uncached <= 0:
            return
        self._timings[beside].append((uncached, cached, seconds))
        self.respeed(model)

    def respeed(self, model: PrefillTimeModel) -> None:
        """Its speeds against `model` (the fitted model changed): the mean ratio of their
        timings to the model's predictions, clamped to `SPEED_RANGE`. Kept as a running mean of
        ratios taken when they came, a speed outlived the model it was measured against: as the
        model learned, the speeds learned against its prior multiplied it again (an engine whose
        start-up probe ran slow would be priced up to twice what its prompts take)."""
        alone = _mean_ratio(self._timings[False], model)
        beside = _mean_ratio(self._timings[True], model)
        alone = self.prefill_speed if alone is None else alone
        if (alone, beside) != (self.prefill_speed, self.prefill_speed_beside):
            self.prefill_speed, self.prefill_speed_beside = alone, beside
            self._changed()

    def prefills_in_flight(self) -> int:
        return len(self._prefills)

    # ------------------------------------------------------------------ decode

    def add_decode(self, request_id: str, prompt_tokens: int, finish_at: float,
                   sequences: int = 1) -> None:
        """A decode request of `sequences` choices sharing one prompt's KV."""
        if request_id in self._decodes:
            self.end_decode(request_id)
        self._decodes[request_id] = _Decode(prompt_tokens, 0, finish_at, sequences)
        at = bisect_left(self._finishes, finish_at)
        self._finishes[at:at] = [finish_at] * sequences
        self.kv_tokens += prompt_tokens
        if request_id in self._prefills:
            self._both += 1
        else:
            self.dispatched_total += 1
        self._changed()

    def decode_progress(self, request_id: str, tokens: int) -> None:
        """Tokens generated. Snapshots see them a block at a time per instance (a decision
        needs KV use to a block, not to a token, and streams must not re-freeze the load per
        token)."""
        d = self._decodes.get(request_id)
        if d is not None:
            d.generated += tokens
            self.kv_tokens += tokens
            self._unseen += tokens
            if self._unseen >= self.block_size:
                self._changed()

    def end_decode(self, request_id: str) -> None:
        d = self._decodes.pop(request_id, None)
        if d is not None:
            self.kv_tokens -= d.prompt_tokens + d.generated
            f = self._finishes
            at = bisect_left(f, d.finish_at)
            del f[at:at + d.sequences]
            self._both -= request_id in self._prefills
            self._changed()

    def running(self) -> int:
        """Sequences decoding here (a request of `n` choices counts `n`)."""
        return len(self._finishes)

    def streams_until(self) -> float:
        """When the last of its decodes is predicted to finish (0: none)."""
        return self._finishes[-1] if self._finishes else 0.0

    # ------------------------------------------------------------------ view

    def in_flight(self) -> int:
        return len(self._prefills) + len(self._decodes) - self._both

    def view(self, cached_blocks: int = 0) -> InstanceLoad:
        """The load frozen; the same object until the load (or `cached_blocks`) changes."""
        v = self._view
        if v is not None and v.cached_blocks == cached_blocks:
            return v
        v = self._view = InstanceLoad(
            instance_id=self.instance_id,
            role=self.role,
            in_flight=self.in_flight(),
            queued_prompt_tokens=self.queued_prompt_tokens,
            block_size=self.block_size,
            queued_uncached_tokens=self.queued_uncached_tokens,
            busy_until=self._head_started + self._work_s if self._prefills else 0.0,
            running=len(self._finishes),
            kv_tokens=self.kv_tokens,
            kv_capacity_tokens=self.kv_capacity_tokens,
            finishes=tuple(self._finishes),
            max_seqs=self.max_seqs,
            cached_blocks=cached_blocks,
            host=self.host,
            cores=self.cores,
            threads=self.threads,
            side=self.side,
            gpus=self.gpus,
            prefill_speed=self.prefill_speed,
            prefill_speed_beside=self.prefill_speed_beside,
        )
        return v


def _mean_ratio(timings: deque[tuple[int, int, float]], model: PrefillTimeModel
                ) -> float | None:
    """The timings' mean ratio to `model`'s predictions, clamped to `SPEED_RANGE`."""
    if not timings:
        return None
    ratios = [seconds / max(model.predict(u, c), 1e-9) for u, c, seconds in timings]
    return min(max(sum(ratios) / len(ratios), SPEED_RANGE[0]), SPEED_RANGE[1])
