"""The conductor's scheduler, one concept per module, and its public surface (import from here):

- `snapshot.py`: the immutable views a policy reads (`ClusterSnapshot`, `RouteRequest`) and
  what it answers (`Route`, `Reject`)
- `policy.py`: the routing policies by name; `policies/`: one per file, pure functions of a
  snapshot
- `index.py`: the global KV index (which blocks are in the pool and in each engine's cache)
- `load.py`: per-instance load counted at dispatch time
- `prefill_model.py`, `decode_model.py`: fitted prefill-time and TBT models
- `regression.py`: the bounded, prior-anchored least-squares fit both models use
- `events.py`: follows the workers' KV event streams into the index
- `pool_sync.py`: the index's pool view kept in step with the pool

Nothing here imports the conductor above it; `conductor/router.py` ties the scheduler to the
registry and the pipeline; the simulator and the benchmarks import this package only.
"""

from conductor.scheduler.decode_model import TbtFitter, TbtModel
from conductor.scheduler.index import POOL, KVIndex
from conductor.scheduler.load import LoadState
from conductor.scheduler.policies.estimate import loadable_blocks
from conductor.scheduler.policy import (
    DECODES_ALONE,
    DEFAULT_POLICY,
    POLICIES,
    Decision,
    Policy,
)
from conductor.scheduler.prefill_model import PrefillTimeFitter, PrefillTimeModel
from conductor.scheduler.prefill_model import features as prefill_features
from conductor.scheduler.snapshot import (
    ClusterSnapshot,
    InstanceLoad,
    PrefixMatch,
    Reject,
    Route,
    RouteRequest,
    SchedulerParams,
    contention,
)

__all__ = ["DECODES_ALONE", "DEFAULT_POLICY", "POLICIES", "POOL", "ClusterSnapshot", "Decision",
           "InstanceLoad",
           "KVIndex", "LoadState", "Policy", "PrefillTimeFitter", "PrefillTimeModel",
           "PrefixMatch", "Reject", "Route", "RouteRequest", "SchedulerParams", "TbtFitter",
           "TbtModel", "contention", "loadable_blocks", "prefill_features"]
