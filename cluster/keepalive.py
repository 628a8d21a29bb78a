"""gRPC keepalive between the conductor and the workers: a peer that stops answering (a
stopped process, a partitioned host, a half-open connection) fails its calls within
`CLIENT`'s time + timeout, instead of holding them until their deadline."""

from __future__ import annotations

PING_S = 10
TIMEOUT_S = 5

CLIENT: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", PING_S * 1000),
    ("grpc.keepalive_timeout_ms", TIMEOUT_S * 1000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)
"""For channels to workers."""

SERVER: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", PING_S * 1000),
    ("grpc.keepalive_timeout_ms", TIMEOUT_S * 1000),
    ("grpc.keepalive_permit_without_calls", 1),
    # accept the clients' pings: by default a server answers pings more often than every
    # 5 minutes with GOAWAY (too_many_pings), which would close the channel
    ("grpc.http2.min_recv_ping_interval_without_data_ms", PING_S * 1000 // 2),
    ("grpc.http2.max_ping_strikes", 0),
)
"""For the workers' servers."""
