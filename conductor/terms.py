"""The cluster's terms: what an instance must agree on to be routed (its model, KV namespace and
block size), and the parameters the cluster then takes from the instances that agree (the
block size requests are hashed with, the context they must fit, the namespace of the pool's
keys).

The conductor's configuration fixes what it says (the model it serves, a block size); the rest
is what most of the instances that proved themselves hold, so that one misconfigured worker
cannot outvote its peers; a tie keeps the terms in force, so that they do not flip while
instances come and go. Only verified instances are counted: an etcd entry whose worker proved
nothing has no say (`conductor.registry`, `conductor.health`). Pure functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cluster.instance import InstanceInfo


@dataclass(frozen=True)
class Expected:
    """What the conductor's configuration fixes."""

    models: frozenset[str] = frozenset()
    """The model names an instance may register (the conductor's served name, its model
    directory's name); empty: any, the instances agreeing among themselves."""
    block_size: int = 0
    """The cluster's block size; 0: the instances'."""


@dataclass(frozen=True)
class Terms:
    """The terms in force, and the cluster parameters the agreeing instances give."""

    model: str = ""
    block_size: int = 0
    """Tokens per KV block requests are hashed with; 0: none yet (no instance agrees and no
    block size is configured)."""
    kv_namespace: str = ""
    max_model_len: int = 0
    """The smallest context the agreeing instances announced; 0: none announced one (the
    model's own)."""


def agree(expected: Expected, verified: Sequence[InstanceInfo], current: Terms
          ) -> tuple[Terms, dict[str, str]]:
    """The terms, from the verified instances (in the order they proved themselves) and those
    in force; and why each verified instance that disagrees is left out (id -> reason)."""
    out: dict[str, str] = {}
    groups: dict[tuple[str, int, str], list[InstanceInfo]] = {}
    for info in verified:
        why = _against_config(expected, info)
        if why:
            out[info.instance_id] = why
        else:
            groups.setdefault(_key(expected, info), []).append(info)
    if not groups:
        return Terms(block_size=expected.block_size), out
    most = max(len(g) for g in groups.values())
    now = _key(expected, current)
    key = now if len(groups.get(now, ())) == most else next(
        k for k, g in groups.items() if len(g) == most)  # dicts keep the order of proof
    chosen = groups[key][0]
    terms = Terms(model=chosen.model, block_size=chosen.block_size,
                  kv_namespace=chosen.kv_namespace,
                  max_model_len=min((i.max_model_len for i in groups[key] if i.max_model_len),
                                    default=0))
    for k, group in groups.items():
        if k != key:
            out.update((i.instance_id, _differs(i, chosen)) for i in group)
    return terms, out


def _key(expected: Expected, info: InstanceInfo | Terms) -> tuple[str, int, str]:
    return ("" if expected.models else info.model, info.block_size, info.kv_namespace)


def _against_config(expected: Expected, info: InstanceInfo) -> str:
    if expected.models and info.model not in expected.models:
        return f"model {info.model!r}, the conductor serves {' or '.join(sorted(expected.models))}"
    if expected.block_size and info.block_size != expected.block_size:
        return (f"block size {info.block_size}, the conductor's is {expected.block_size} "
                "(--block-size)")
    return ""


def _differs(info: InstanceInfo, chosen: InstanceInfo) -> str:
    if info.model != chosen.model:
        return f"model {info.model!r}, the cluster's is {chosen.model!r}"
    if info.block_size != chosen.block_size:
        return f"block size {info.block_size}, the cluster's is {chosen.block_size}"
    return f"KV namespace {info.kv_namespace!r}, the cluster's is {chosen.kv_namespace!r}"
