"""The peers' routers, re-implemented from their published source to run in the simulator on
the same cluster, trace and SLOs as the conductor's policies, one module per router (each
cites the files and commits it follows):

- `dynamo.py`: NVIDIA Dynamo's KV router (prefix overlap against active prefill and decode
  blocks; overlap credit, softmax temperature)
- `llm_d.py`: llm-d's endpoint picker, its default weighted scorers (prefix cache, queue,
  KV-cache utilisation) and its prefix-based P/D decider
- `vllm_router.py`: vllm-router's cache_aware policy in its P/D mode
- `smg.py`: SMG's cache_aware policy (radix tree, spill gate) in its P/D mode

`base.py` holds what they share. Each router keeps its own state in its object, so `make(name)`
returns a fresh one per run; none rejects a request.
"""

from __future__ import annotations

from collections.abc import Callable

from simulator.peers.base import EngineMetrics, PeerRouter
from simulator.peers.dynamo import DynamoRouter
from simulator.peers.llm_d import LlmdRouter
from simulator.peers.smg import SmgRouter
from simulator.peers.vllm_router import VllmRouter

PEERS: dict[str, Callable[[], PeerRouter]] = {
    "dynamo": DynamoRouter,
    "llm_d": LlmdRouter,
    "vllm_router": VllmRouter,
    "smg": SmgRouter,
}


def make(name: str) -> PeerRouter:
    """A fresh router of that name (its state starts empty)."""
    return PEERS[name]()


__all__ = ["PEERS", "DynamoRouter", "EngineMetrics", "LlmdRouter", "PeerRouter", "SmgRouter",
           "VllmRouter", "make"]
