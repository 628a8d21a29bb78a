"""Where the pool keeps blocks, asked of Mooncake's master from a host: run inside host A's
namespace by `make test-hosts` (a segment-less pool client, as an operator's script would be).

  python -m tests.hosts.segments MASTER METADATA_URL LOCAL_HOST < keys.json
prints {"key": "segment host:port" or null, ...} as JSON."""

from __future__ import annotations

import json
import sys

from store.pool import MooncakePool, PoolConfig


def main() -> None:
    master, metadata, local_host = sys.argv[1:4]
    keys = json.load(sys.stdin)
    pool = MooncakePool(PoolConfig(master_addr=master, metadata_url=metadata,
                                   local_host=local_host, segment_bytes=0, op_timeout_s=5.0))
    try:
        print(json.dumps({k: pool.segment_of(k) for k in keys}))
    finally:
        pool.close()


if __name__ == "__main__":
    main()
