"""The conductor's scheduler, one concept per module:

- `index.py`: the global KV index (which blocks are in the pool and in each engine's cache)
- `load.py`: per-instance load counted at dispatch time
- `prefill_model.py`, `decode_model.py`: fitted prefill-time and TBT models
- `regression.py`: the bounded, prior-anchored least-squares fit both models use
- `policies/`: one routing policy per file, pure functions of `conductor.snapshot`
- `router.py`: look up, snapshot, decide, account; what the pipeline calls
- `events.py`: follows the workers' KV event streams into the index
"""
