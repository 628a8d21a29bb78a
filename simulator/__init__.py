"""A discrete-event simulator of a prefill/decode cluster that drives the conductor's real
routing policies through `conductor.scheduler.snapshot`, one concept per module:

- `trace.py`: Mooncake-format traces, block-size mapping, load scaling, reuse thinning
- `profile.py`: latency profiles as data (JSON), and the paper's cost model that makes one
- `calibrate.py`: the CPU profile, measured on the repo's vLLM CPU engine
- `pool.py`: a prefix-block cache with capacity and eviction (LRU, LFU)
- `cluster.py`: the cluster's shape and one instance's executor, queues and batch
- `engine.py`: the event loop: arrivals, routing, prefill, transfer, continuous batching
- `report.py`: per-policy metrics, JSON/CSV and plots
- `sweeps.py`: load, capacity and prefix-reuse sweeps
"""
