"""A discrete-event simulator of a prefill/decode cluster that drives the conductor's real
routing policies through `conductor.scheduler.snapshot`, one concept per module:

- `trace.py`: Mooncake-format traces, block-size mapping, load scaling, reuse thinning
- `profile.py`: latency profiles as data (JSON), and the paper's cost model that makes one
- `calibrate.py`: the CPU profile, measured on the repo's vLLM CPU engine
- `pool.py`: a prefix-block cache with capacity and eviction (LRU, LFU)
- `cluster.py`: the cluster's shape and one instance's executor, queues and batch
- `engine.py`: the event loop: arrivals, routing, prefill, transfer, continuous batching
- `replicas.py`: several conductor replicas, each seeing the others' dispatches a sync period late
- `peers/`: the peers' routers (Dynamo, llm-d, vllm-router, SMG), re-implemented from source
- `report.py`: per-policy metrics, TTFT by stage, JSON/CSV and plots
- `sweeps.py`: load, pool-capacity, prefix-reuse and replica sweeps
- `capacity.py`: capacity under SLO (the highest rate 90% of requests meet), by bisection
- `planner.py`: the best prefill/decode split of N instances, and each candidate's capacity
- `comparison.py`: every arm's capacity per profile and the planner's check (`make bench-sim`)
"""
