"""The shared-memory pool on the real stack: an embedded cluster whose workers are Mooncake dummy
clients of one standalone `mooncake_client` (`ClusterSpec.pool_shm`), their KV caches in that
client's shared memory, blocks moved by memcpy (docs/benchmarks.md, bench-kv)."""

from __future__ import annotations

import httpx
import pytest
from conftest import BLOCK_SIZE, DTYPE, LEASE_TTL, MAX_MODEL_LEN, MAX_TOKENS
from test_e2e import assert_same_output

from embedded import ClusterSpec, EmbeddedCluster


@pytest.mark.parametrize("checksum", [False, True], ids=["plain", "checksum"])
def test_a_request_through_the_shm_pool_equals_a_single_engine(model_dir, prompt_ids, reference,
                                                                tmp_path, checksum):
    """`checksum`: every block carries its digest (`--kv-checksum`), its slots in the
    client's shared memory too, and every loaded block is verified."""
    spec = ClusterSpec(model=model_dir, prefill=1, decode=1, http_port=0, run_dir=str(tmp_path),
                       kv_checksum=checksum,
                       block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, dtype=DTYPE,
                       kv_cache_bytes=128 << 20, pool_segment_bytes=128 << 20,
                       lease_ttl=LEASE_TTL, admin_port=-1, pool_shm=True,
                       # the decode holds for the prefill whatever the prefill's pace: its
                       # engine runs at SCHED_IDLE beside the serving processes, and a
                       # clean-clone CI run saw the decode give up on it at the 0.5 s margin
                       # (then it computes the prompt itself: same answer, none of the counts)
                       conductor_args=("--disaggregate", "always",
                                       "--pool-wait-margin-s", "60"))
    with EmbeddedCluster(spec) as c:
        assert c.store_client is not None
        prompt = prompt_ids["e2e"]
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
            log = w.process.log_path.read_text(errors="replace")
            assert "kv_cache_in_shared_memory" in log
            assert "kv_checksum_mismatch" not in log and "kv_register_failed" not in log
            assert f"checksum={checksum}" in log
