"""The instances in the orders kv_centric's searches walk, kept sorted as loads change.

Each order is a sorted tuple of entries `(key, ..., position)` over one role's instances,
`position` being the instance's index in `ClusterSnapshot.prefill()` or `.decode()`. The keys
depend on an instance's load alone (not on a request, nor on the clock), so a snapshot builds
them once and a changed load replaces its own entries (`Orders.replacing`: a bisection and one
copy per order) instead of sorting again. Each key bounds part of a route's price from below,
so a search that walks an order may stop once the next key cannot beat what it has priced.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conductor.scheduler.decode_model import TbtModel
    from conductor.scheduler.snapshot import InstanceLoad

SOON = 3
"""`decode_tbt` keys count up to this many of an instance's streams as ended by the time a
prefill does; an instance with more ending sooner is found through `decode_late` and priced on
its own. Any value keeps the choices; it only sets how much a search walks."""

_INF = float("inf")
Entry = tuple


def prefill_wait(i: InstanceLoad) -> float:
    """Its fastest speed times the prompts it is as slow as: itself and its own streams."""
    return i.fastest * (1 + (i.running if i.can_decode() else 0))


def odd_prefill(i: InstanceLoad) -> bool:
    """Priced one by one by kv_centric: a side engine (its price scaled), or one whose
    `finishes` outlast the streams it is counted as decoding (its twins are not alike)."""
    return i.side or bool(i.finishes) and not (i.can_decode() and i.running)


def _prefill_entries(i: InstanceLoad, pos: int) -> dict[str, Entry]:
    return {"prefill_speed": (i.fastest, pos),
            "prefill_wait": (prefill_wait(i), i.busy_until, i.instance_id, pos)}


def _decode_entries(i: InstanceLoad, pos: int, tbt: TbtModel) -> dict[str, Entry]:
    fin = i.finishes
    load_s = tbt.per_seq_s * i.running + tbt.per_kv_token_s * i.kv_tokens
    return {"decode_wait": (i.fastest * (1 + max(i.running, 0)), pos),
            "decode_busy": (i.busy_until, pos),
            "decode_first": (fin[0] if fin else _INF, pos),
            "decode_tbt": (load_s - max(tbt.per_seq_s, 0.0) * min(SOON, len(fin)), pos),
            "decode_late": (fin[SOON] if len(fin) > SOON else _INF, pos),
            "decode_speed": (i.fastest, pos)}


@dataclass(frozen=True)
class Orders:
    prefill_speed: tuple[Entry, ...]
    """(fastest speed, position): the first is the fastest prefill-capable instance."""
    prefill_wait: tuple[Entry, ...]
    """(`prefill_wait`, busy_until, id, position): ties in queue order."""
    prefill_odd: frozenset[int]
    """Positions of the prefill-capable instances priced one by one (`odd_prefill`)."""
    prefill_classes: Mapping[tuple, tuple[str, ...]]
    """(`prefill_wait`, `InstanceLoad.prefill_like`) -> the ids, in order, of the instances
    of that class with no prefill queued (busy_until 0) and not odd: idle, they are priced
    alike but for their hits."""
    prefill_class_order: tuple[tuple, ...]
    """(wait, first id, class) of every class in `prefill_classes`, sorted."""
    decode_wait: tuple[Entry, ...]
    """(fastest speed x (1 + running), position): what a prompt computed there costs, per
    second the fitted model gives it, with its streams waiting."""
    decode_busy: tuple[Entry, ...]
    """(busy_until, position): when its own queued prompts end."""
    decode_first: tuple[Entry, ...]
    """(its first predicted finish, position; inf: none)."""
    decode_tbt: tuple[Entry, ...]
    """(the TBT model's load term, less `SOON` streams ending, position)."""
    decode_late: tuple[Entry, ...]
    """(the finish of its stream `SOON + 1` in order, position; inf: none)."""
    decode_speed: tuple[Entry, ...]
    """(fastest speed, position)."""
    decode_side: frozenset[int]
    """Positions of the side instances among the decode-capable ones."""
    decode_odd_block: frozenset[int]
    """Positions of decode-capable instances of another block size than the first's."""
    decode_hosts: Mapping[str, frozenset[int]]
    """host -> positions of the decode-capable instances on it (named hosts only)."""

    @staticmethod
    def build(prefill: tuple[InstanceLoad, ...], decode: tuple[InstanceLoad, ...],
              tbt: TbtModel) -> Orders:
        per_seq, per_kv, soon = tbt.per_seq_s, tbt.per_kv_token_s, max(tbt.per_seq_s, 0.0)
        return Orders(
            prefill_speed=_by([i.fastest for i in prefill]),
            prefill_wait=tuple(sorted((prefill_wait(i), i.busy_until, i.instance_id, pos)
                                      for pos, i in enumerate(prefill))),
            decode_wait=_by([i.fastest * (1 + max(i.running, 0)) for i in decode]),
            decode_busy=_by([i.busy_until for i in decode]),
            decode_first=_by([i.finishes[0] if i.finishes else _INF for i in decode]),
            decode_tbt=_by([per_seq * i.running + per_kv * i.kv_tokens
                            - soon * min(SOON, len(i.finishes)) for i in decode]),
            decode_late=_by([i.finishes[SOON] if len(i.finishes) > SOON else _INF
                             for i in decode]),
            decode_speed=_by([i.fastest for i in decode]),
            **_classes(prefill),
            **_sets(prefill, decode))

    def replacing(self, prefill_changes: Iterable[tuple[int, InstanceLoad, InstanceLoad]],
                  decode_changes: Iterable[tuple[int, InstanceLoad, InstanceLoad]],
                  prefill: tuple[InstanceLoad, ...], decode: tuple[InstanceLoad, ...],
                  tbt: TbtModel) -> Orders:
        """These orders with the changed instances' entries replaced: (position, old load,
        new load) per change; `prefill` and `decode` are the new instances."""
        lists: dict[str, list[Entry]] = {}
        sets_stale = False
        prefill_changes = list(prefill_changes)
        for changes, entries in ((prefill_changes, _prefill_entries),
                                 (decode_changes, lambda i, p: _decode_entries(i, p, tbt))):
            for pos, old, new in changes:
                sets_stale |= _placement(old) != _placement(new)
                before, after = entries(old, pos), entries(new, pos)
                for name, entry in after.items():
                    if entry == before[name]:
                        continue
                    col = lists.get(name)
                    if col is None:
                        col = lists[name] = list(getattr(self, name))
                    del col[bisect_left(col, before[name])]
                    insort(col, entry)
        fields: dict[str, object] = {name: tuple(col) for name, col in lists.items()}
        moved = [(old, new) for _, old, new in prefill_changes if _class(old) != _class(new)]
        if moved:
            fields.update(self._reclassed(moved))
        if sets_stale:
            fields.update(_sets(prefill, decode))
        if not fields:
            return self
        new = object.__new__(Orders)
        new.__dict__.update(self.__dict__)
        new.__dict__.update(fields)
        return new


    def _reclassed(self, moved: list[tuple[InstanceLoad, InstanceLoad]]) -> dict:
        classes = dict(self.prefill_classes)
        order = list(self.prefill_class_order)
        for old, new in moved:
            iid = old.instance_id
            for key, adding in ((_class(old), False), (_class(new), True)):
                if key is None:
                    continue
                members = classes.get(key, ())
                if members:
                    del order[bisect_left(order, (key[0], members[0]))]
                members = tuple(sorted((*members, iid))) if adding else \
                    tuple(m for m in members if m != iid)
                if members:
                    classes[key] = members
                    insort(order, (key[0], members[0], key))
                else:
                    del classes[key]
        return {"prefill_classes": classes, "prefill_class_order": tuple(order)}


def _class(i: InstanceLoad) -> tuple | None:
    """Its class in `Orders.prefill_classes`, if any."""
    if i.busy_until != 0.0 or odd_prefill(i):
        return None
    return (prefill_wait(i), i.prefill_like)


def _classes(prefill: tuple[InstanceLoad, ...]) -> dict:
    classes: dict[tuple, list[str]] = {}
    for i in sorted(prefill, key=lambda i: i.instance_id):
        key = _class(i)
        if key is not None:
            classes.setdefault(key, []).append(i.instance_id)
    return {"prefill_classes": {k: tuple(v) for k, v in classes.items()},
            "prefill_class_order": tuple(sorted((k[0], v[0], k) for k, v in classes.items()))}


def _by(keys: list[float]) -> tuple[Entry, ...]:
    return tuple(sorted(zip(keys, range(len(keys)), strict=True)))


def _placement(i: InstanceLoad) -> tuple:
    return (odd_prefill(i), i.side, i.block_size, i.host)


def _sets(prefill: tuple[InstanceLoad, ...], decode: tuple[InstanceLoad, ...]) -> dict:
    hosts: dict[str, set[int]] = {}
    for pos, i in enumerate(decode):
        if i.host:
            hosts.setdefault(i.host, set()).add(pos)
    bs = decode[0].block_size if decode else 0
    return {"prefill_odd": frozenset(p for p, i in enumerate(prefill) if odd_prefill(i)),
            "decode_side": frozenset(p for p, i in enumerate(decode) if i.side),
            "decode_odd_block": frozenset(p for p, i in enumerate(decode) if i.block_size != bs),
            "decode_hosts": {h: frozenset(v) for h, v in hosts.items()}}
