"""The shared-memory pool on the real stack: an embedded cluster whose workers are Mooncake dummy
clients of one standalone `mooncake_client` (`ClusterSpec.pool_shm`), their KV caches in that
client's shared memory, blocks moved by memcpy (docs/benchmarks.md, bench-kv)."""

from __future__ import annotations

import httpx
from conftest import BLOCK_SIZE, DTYPE, LEASE_TTL, MAX_MODEL_LEN, MAX_TOKENS
from test_e2e import assert_same_output

from conductor.launcher import ClusterSpec, EmbeddedCluster


def test_a_request_through_the_shm_pool_equals_a_single_engine(model_dir, prompt_ids, reference,
                                                                tmp_path):
    spec = ClusterSpec(model=model_dir, prefill=1, decode=1, http_port=0, run_dir=str(tmp_path),
                       block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, dtype=DTYPE,
                       kv_cache_bytes=128 << 20, pool_segment_bytes=128 << 20,
                       lease_ttl=LEASE_TTL, admin_port=-1, pool_shm=True,
                       conductor_args=("--disaggregate", "always"))
    with EmbeddedCluster(spec) as c:
        assert c.store_client is not None
        prompt = prompt_ids["e2e"]
        # A fresh engine's first request with logprobs takes 2 s (measured here, eager, on
        # CPU): the decode would stop holding for the prefill and race it (the answer is the
        # same, but only the prefill's counts the saves asserted below). One such first.
        warm = httpx.post(f"{c.url}/v1/completions", timeout=120, json={
            "prompt": prompt_ids["control"][:len(prompt)], "max_tokens": 2, "temperature": 0,
            "logprobs": 1})
        assert warm.status_code == 200, warm.text
        r = httpx.post(f"{c.url}/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1,
            "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        body = r.json()
        kv = body["kv_transfer"]
        assert kv["blocks_saved"] == kv["blocks_in_pool"] == len(prompt) // BLOCK_SIZE
        assert kv["blocks_loaded"] == (len(prompt) - 1) // BLOCK_SIZE
        choice = body["choices"][0]
        assert_same_output(choice["token_ids"], choice["logprobs"]["token_logprobs"],
                           reference["e2e"])
        for w in c.workers.values():  # each engine's cache is the client's shared memory
            assert "kv_cache_in_shared_memory" in w.process.log_path.read_text(errors="replace")
