"""A Mooncake pool client in another host (network namespace), driven line by line from
tests/test_pool_partition.py: `call` makes one lookup (the test drops its reply), `healed`
times how long after the network is back the pool answers again, and how long the call stuck
on the lost reply takes to return. Answers are JSON lines."""

from __future__ import annotations

import json
import os
import sys
import time

from store.pool.config import PoolConfig
from store.pool.mooncake import MooncakePool

POLL_S = 0.02
LIMIT_S = 20.0
KEY = "partition-probe"


def main() -> None:
    master, me = sys.argv[1], sys.argv[2]
    pool = MooncakePool(PoolConfig(master_addr=f"{master}:50051",
                                   metadata_url=f"http://{master}:8080/metadata",
                                   local_host=me, segment_bytes=0, local_buffer_bytes=16 << 20,
                                   op_timeout_s=1.0))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() == "call":
            t0 = time.monotonic()
            found = pool.exists([KEY])
            print(json.dumps({"found": found, "took_s": time.monotonic() - t0,
                              "healthy": pool.healthy(),
                              "stuck": len(pool._calls.stuck)}), flush=True)
        elif line.strip() == "healed":
            t0 = time.monotonic()
            answered = stuck_returned = None
            while time.monotonic() - t0 < LIMIT_S and (answered is None or stuck_returned is None):
                now = time.monotonic() - t0
                if answered is None and pool.healthy() and pool.exists([KEY]) == [False]:
                    answered = now
                if stuck_returned is None and not pool._calls.running:
                    stuck_returned = now
                time.sleep(POLL_S)
            print(json.dumps({"answered_s": answered, "stuck_returned_s": stuck_returned}),
                  flush=True)
            os._exit(0)  # skip Mooncake's teardown: the test tears the hosts down


if __name__ == "__main__":
    main()
