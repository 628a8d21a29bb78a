"""What a worker's standard health service (`grpc.health.v1`) says, as its conductor reads it.

`SERVICE` is SERVING while the worker takes requests; NOT_SERVING once it drains (graceful
shutdown: its calls in flight finish); `STALLED` while its engine holds requests and makes no
progress (`worker.progress`): its calls in flight will not finish, and the conductor cancels
them so that their requests move elsewhere (`conductor.health`)."""

from __future__ import annotations

from grpc_health.v1 import health_pb2

SERVICE = "kvcluster.v1.Worker"
STALLED = health_pb2.HealthCheckResponse.UNKNOWN
"""The standard protocol's status for "neither serving nor not": alive, answering, and
making no progress."""
