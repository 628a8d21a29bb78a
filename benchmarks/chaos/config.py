"""The run's fixed settings."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REFERENCE_ENGINE = ROOT / "tests" / "reference_engine.py"

BLOCK_SIZE = 32
MAX_MODEL_LEN = 2048
DTYPE = "float32"
MAX_TOKENS = (16, 48)
"""Each request asks for a length in this range (ignore_eos: it gets exactly that many)."""
LOGPROB_TOL = 1e-3
"""A token's logprob further than this from the reference's counts as logprob drift: a
diagnostic of a wrong KV prefix (the tiny model's greedy tokens seldom flip when an early
block is wrong, its logprobs do), reported beside the classes, not one of them."""
CLASSES = ("ok", "clean_error", "wrong", "hung", "lost")
FAULTS = ("decode", "prefill", "store", "etcd", "stall_decode", "stall_engine", "stall_store")
STALL_TIMEOUT_S = 10.0
"""The conductor's inter-token deadline (`--stall-timeout-s`), set explicitly: derived, it
would be 30x the requests' TBT SLO, which this run sets out of reach (`--slo-ms`)."""
STALL_DECODE_S = 15.0
"""How long a decode worker stands still (SIGSTOP): past the inter-token deadline, so its
streams move on."""
STALL_ENGINE_AFTER_S = 3.0
"""How long a decode engine's core stays stopped once the conductor shows it unhealthy."""
STALL_STORE_S = 8.0
"""How long the Mooncake master stands still: past the pool's op timeout (5 s)."""
DUPLICATE_EVERY = 5
"""Requests 5k and 5k+1 send the same client request id (`request_id`): ordinary (a retry, a
copied snippet), and each must get its own answer."""
MEMBERSHIP_PREFIX = "/kvcluster/instances/"

