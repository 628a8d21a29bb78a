"""Our vLLM KV connector: every full block a request computes (its prompt's, then those its
generated tokens fill) goes to the Mooncake Store pool, and a request's prefix that the pool
holds (or that a prefill elsewhere is writing) is loaded into vLLM's paged KV cache,
asynchronously, while the engine keeps stepping its other requests.

Loaded by vLLM through `KVTransferConfig(kv_connector="PoolConnector",
kv_connector_module_path="store.connector", kv_connector_extra_config={...})`; the extra
config is `settings.ConnectorSettings`. Roles: `kv_producer` saves, `kv_consumer` loads,
`kv_both` does both.

In vLLM's connector layout: `connector.py` the class vLLM instantiates (once per side),
`scheduler.py` its scheduler side (what to load and save), `worker.py` its worker side with
the `loader.py` and `saver.py` threads (moving bytes), `data.py` what the two sides pass each
other, `settings.py` the configuration and the pool client. The bytes move through
`store.kv_transfer` (one pool object per block holding every layer's slice of it, so an
object is independent of how a backend lays a block out: copied whole, never split into K
and V), by Mooncake's zero-copy batch calls: no Python-level copy.

Saves run on a background thread, after a `batch_is_exist` that skips blocks already pooled
(a shared prefix is written once cluster-wide); a finished request's blocks stay allocated
(`request_finished` answers "delay free") until its saves are done (`get_finished`). No pool
call outlives the blocks it reads or writes, however long it takes, also when vLLM preempts
or aborts the request meanwhile, or the pool gave up on the call (see `worker`).

Generated blocks (`save_generated`) are what a stream that migrates after its decode instance
died needs: the continuation's prompt is the prompt plus the tokens sent, whose chained
hashes are those of the blocks the dead instance filled, so the new instance loads them and
recomputes only the last partial block. They go to the segment holding the request's last
full prompt block (asked of the master, `ZeroCopyPool.segment_of`), not the writer's own,
which would die with exactly the instance whose death they are for: in the disaggregated flow
that is the prefill instance's segment. When that segment is full or gone, Mooncake places
the blocks anywhere.

The pool failing never fails a request: a save that cannot be made is skipped and counted; a
load that cannot be made (or a block that does not arrive in time) is reported to vLLM as
invalid blocks, which it recomputes (`kv_load_failure_policy="recompute"`), and counted.
Counters (`KVTransfer.stats`, `LookupStats`) and the request's load times leave the engine in
every finished request's `kv_transfer_params` (`pool_stats`, `pool_times`).
"""

from store.connector.connector import PoolConnector

__all__ = ["PoolConnector"]
