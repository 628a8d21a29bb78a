"""A worker process: engine, gRPC server with health, etcd registration, ordered shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cluster import keepalive, plane_tls
from cluster.health import SERVICE
from cluster.instance import PROBE_TOKENS, InstanceInfo, cpu_list, format_cpu_list, host_port
from cluster.logging import configure
from cluster.membership import Registration
from cluster.plane_tls import PlaneTLS
from cluster.secret import RequireToken
from protos import worker_pb2_grpc
from worker.config import WorkerConfig, parse_args
from worker.engine import Engine
from worker.servicer import WorkerServicer
from worker.watchdog import Watchdog

log = structlog.get_logger(__name__)

VERSION = "0.1.0"


async def serve(config: WorkerConfig) -> bool:
    """Serve until told to stop (True) or the engine dies (False)."""
    engine = Engine(config)
    try:
        return await _serve(config, engine)
    finally:  # also when it failed to start: its processes and socket files go
        engine.shutdown()


async def _serve(config: WorkerConfig, engine: Engine) -> bool:
    engine.start()
    probe_s = await engine.probe_prefill(PROBE_TOKENS) if config.prefill_probe else 0.0
    servicer = WorkerServicer(engine, config.instance_id, config.role)
    secret = config.cluster_secret
    guard = RequireToken(secret) if secret is not None else None
    server = grpc.aio.server(interceptors=[guard] if guard else None,
                             options=[("grpc.so_reuseport", 0), *keepalive.SERVER])
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = _bind(server, config.host, config.port, config.tls)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    watchdog = Watchdog(engine.progress, engine.running, engine.ping, health_servicer,
                        config.instance_id)

    info = InstanceInfo(
        instance_id=config.instance_id,
        role=config.role,
        address=host_port(config.advertise_host, port),
        model=config.served_model_name,
        block_size=config.block_size,
        capacity_tokens=engine.kv_capacity_tokens(),
        version=VERSION,
        started_at=time.time(),
        kv_namespace=engine.namespace,
        max_model_len=config.max_model_len,
        max_seqs=config.max_num_seqs,
        prefill_probe_s=probe_s,
        side=config.side,
        **placement(config.device),
    )
    servicer.registration = info.to_json()
    if guard is not None:  # Worker calls are refused until here
        guard.bind(info.address)
    registration = Registration(config.etcd_access, info, ttl=max(2, round(config.lease_ttl)))
    await registration.start()
    log.info("worker_ready", instance_id=config.instance_id, role=config.role,
             prefill_probe_ms=round(probe_s * 1e3, 1),
             address=info.address, authenticated=secret is not None,
             tls=config.tls is not None)
    print(f"READY {config.instance_id} {info.address}", flush=True)

    stop = asyncio.Event()
    servicer.on_retire = stop.set
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        dead = await _until_stopped_or_dead(stop, engine, watchdog)
    finally:
        await watchdog.close()
    if dead is not None:
        log.error("engine_dead", instance_id=config.instance_id, error=repr(dead))

    # Ordered shutdown: stop being routed to, drain in-flight RPCs, then stop the engine.
    log.info("worker_stopping", instance_id=config.instance_id)
    await health_servicer.enter_graceful_shutdown()
    await registration.stop()
    await server.stop(grace=0.0 if dead is not None else 10.0)
    engine.shutdown()
    log.info("worker_stopped", instance_id=config.instance_id)
    return dead is None


def _bind(server: grpc.aio.Server, host: str, port: int, tls: PlaneTLS | None = None
          ) -> int:
    """Listen on `port`, or on one the kernel picks when another process took it while the
    engine loaded (a launcher picks the port free ~40 s before the worker binds it): the
    worker registers and prints (`READY`) the port it got, so nothing is lost."""
    try:
        got = plane_tls.bind(server, f"{host}:{port}", tls)
    except RuntimeError:  # grpcio raises where older releases returned 0
        got = 0
    if got == 0 and port != 0:
        log.warning("port_taken", port=port)
        got = plane_tls.bind(server, f"{host}:0", tls)
    if got == 0:
        raise RuntimeError(f"cannot listen on {host}")
    return got


async def _until_stopped_or_dead(stop: asyncio.Event, engine: Engine, watchdog: Watchdog
                                 ) -> BaseException | None:
    """Wait for `stop`, or for the engine core to die: a worker whose engine is dead answers
    every call with an error, so it leaves (lease revoked, exit status 1) for its supervisor
    to start another rather than stay routed to. Meanwhile the watchdog says whether the
    engine makes progress."""
    while not stop.is_set():
        if (dead := engine.dead()) is not None:
            return dead
        await watchdog.check()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), engine.progress.check_s)
    return None


def placement(device: str) -> dict:
    """Where this worker's engine computes, for the conductor's contention model: its cores
    (the OpenMP binding, else this process's affinity) and threads, or its GPUs."""
    if device == "cuda":
        return {"gpus": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    try:
        cores = cpu_list(bind.replace("|", ","))
    except ValueError:  # auto / nobind
        cores = frozenset(os.sched_getaffinity(0))
    threads = os.environ.get("OMP_NUM_THREADS", "")
    return {"cpus": format_cpu_list(cores),
            "threads": int(threads) if threads.isdigit() else len(cores)}


def main(role: str, argv: list[str] | None = None) -> None:
    config = parse_args(argv, role)
    configure(f"{role}_worker")
    if not asyncio.run(serve(config)):
        raise SystemExit(1)
