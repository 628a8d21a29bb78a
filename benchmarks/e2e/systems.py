"""The systems (arms) `make bench-e2e` compares, each deployed the way its own users deploy
it, on the same cores and the same total KV memory (P + D engines' worth):

1. `kv_centric`: our embedded cluster (etcd, Mooncake master, workers, the conductor) in the
   shape the conductor chooses for this machine (`cluster.shape.choose`, what `make run`
   starts: on two cores one engine, its model worker alone on core 1), holding all the KV.
2. `kv_centric_2p2d`: the same conductor forced into P prefill + D decode engines (Mooncake's
   shape), unpinned, the cores shared out.
3. `round_robin`: our conductor with round-robin routing over arm 1's shape (the pool alone,
   no KV-aware scoring).
4. `vllm_router`: the Rust `vllm-router` (PyPI) in vLLM prefill/decode mode, in front of P + D
   plain `vllm serve` OpenAI servers started with our KV connector
   (`kv_connector_module_path=store.connector`) and a Mooncake master, with its default policy
   (`cache_aware`).
5. `vllm_router_dp`: `vllm-router` in its regular mode, `cache_aware`, over one colocated
   `vllm serve` with prefix caching per core (data parallel, no P/D): the deployment most of
   its users run.
6. `colocated`: one `vllm serve` with prefix caching, no disaggregation.

Each system exposes an OpenAI base URL and, for the added-latency probe, a way to send a
1-token request straight to one of its engines.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx

from benchmarks import conductor_log
from cluster import shape
from cluster.engine_spec import EngineSpec
from cluster.ports import free_port
from cluster.process import IPC_ENV, ManagedProcess, vllm_scratch
from embedded import ClusterSpec, EmbeddedCluster
from protos import worker_pb2
from store.master import StoreClientService, StoreMaster
from store.namespace import kv_namespace
from worker.vllm_plugin import CPU_VLLM_ENV


@dataclass(frozen=True, kw_only=True)
class Engines(EngineSpec):
    """What every system runs on (our engines compiled, as `vllm serve` runs)."""

    model: str
    prefill: int = 2
    decode: int = 1
    max_model_len: int = 4096
    kv_cache_bytes: int = 512 << 20
    pool_segment_bytes: int = 1 << 30
    enforce_eager: bool = False
    max_num_seqs: int = 64
    cores: int = os.cpu_count() or 1
    pool_shm: bool = True
    """The pool's transport for the disaggregated systems: one `mooncake_client`'s shared
    memory (memcpy), the best Mooncake offers on one host; False: each engine a TCP segment."""

    @property
    def threads(self) -> int:
        """OMP threads per disaggregated engine: the cores shared out, at least one. Engines
        are not pinned: pinned engines (`VLLM_CPU_OMP_THREADS_BIND=0`, `=1`) starved the
        Mooncake transfer threads that share their core (pool reads stalled for 60 s), and
        unpinned engines with a thread per core each (`nobind`) thrash (a 768-token prefill
        10x slower with three of them)."""
        return max(1, self.cores // (self.prefill + self.decode))

    def env(self, threads: int) -> dict[str, str]:
        return {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads)}

    @property
    def served_name(self) -> str:
        return os.path.basename(self.model.rstrip("/"))


@dataclass
class Running:
    """A started system: where to send requests, how to probe an engine directly, how to stop."""

    name: str
    url: str
    model: str
    stop: Callable[[], None]
    direct: Callable[[str, str | None], float] | None = None
    """Send a 1-token greedy request for this prompt straight to an engine; its seconds. The
    second argument is the `X-Request-Id` of the same request sent through the system: where
    the system says which engine served it, the direct request goes to that engine."""
    logs: Path | None = None
    extra: dict = field(default_factory=dict)

    def warm_up(self) -> None:
        """One short request, so that no workload sent first pays a cold path."""
        httpx.post(f"{self.url}/v1/completions", timeout=300, json={
            "model": self.model, "prompt": "warm up", "max_tokens": 2, "temperature": 0,
        }).raise_for_status()


def _wait_http(url: str, procs: list[ManagedProcess], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if not p.alive():
                raise RuntimeError(f"{p.name} exited while starting {what}:\n{p.tail(30)}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{what} not ready after {timeout:.0f}s ({url})")


def _engine_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    for k, v in CPU_VLLM_ENV.items():  # every arm's engines start alike (and sooner)
        env.setdefault(k, v)
    return env


# --------------------------------------------------------------------------- ours


def ours(name: str, policy: str, e: Engines, run_dir: Path, ttft_slo_s: float,
         tbt_slo_s: float, *, mooncake_shape: bool) -> Running:
    """Our cluster; `mooncake_shape`: P prefill + D decode engines, unpinned (else the shape
    `make run` chooses, its engines holding all P + D engines' KV memory between them)."""
    kwargs = e.engine_kwargs()
    if mooncake_shape:
        layout = {"prefill": e.prefill, "decode": e.decode,
                  "worker_env": tuple(e.env(e.threads).items())}
    else:
        chosen = shape.choose(shape.machine_cores())
        kwargs["kv_cache_bytes"] = e.kv_cache_bytes * (e.prefill + e.decode) \
            // len(chosen.engines)
        layout = {"shape": chosen}
    spec = ClusterSpec(model=e.model, http_port=0, run_dir=str(run_dir), policy=policy,
                       pool_shm=e.pool_shm, **layout, **kwargs,
                       conductor_args=("--ttft-slo-s", str(ttft_slo_s),
                                       "--tbt-slo-s", str(tbt_slo_s)))
    c = EmbeddedCluster(spec).start(timeout=600)
    try:
        _wait_instances(c, spec.engines(), 600)
    except BaseException:
        c.stop()
        raise
    channels = {iid: c.worker_channel(w.address) for iid, w in c.workers.items()}
    stubs = {iid: c.worker_stub(c.workers[iid].address, ch) for iid, ch in channels.items()}
    first_decode = next(iid for iid, w in c.workers.items() if w.role in ("decode", "both"))
    served_by = _ServedBy(Path(c.run_dir) / "conductor.log")
    tok = _tokenizer(e.model)

    def direct(prompt: str, through_id: str | None) -> float:
        # the engine the conductor chose: engines sharing cores unpinned differ in speed
        # (a 66-token prompt took 16 ms on one, 23 ms on another), more than the hop costs
        stub = stubs[served_by(through_id) or first_decode]
        ids = tok.encode(prompt)
        req = worker_pb2.GenerateRequest(
            request_id=f"direct-{time.monotonic_ns()}", token_ids=ids,
            params=worker_pb2.SamplingParams(max_tokens=1, temperature=0.0))
        t0 = time.perf_counter()
        for _ in stub.Generate(req, timeout=60):
            pass
        return time.perf_counter() - t0

    def stop() -> None:
        for ch in channels.values():
            ch.close()
        c.stop()

    return Running(name, c.url, e.served_name, stop, direct, Path(c.run_dir),
                   {"admin_addr": c.admin_addr, "shape": spec.shape.describe()
                    if spec.shape is not None else ""})


class _ServedBy:
    """Which instance decoded a request, from the conductor's `timeline` log lines."""

    def __init__(self, log: Path) -> None:
        self._log, self._offset, self._seen = log, 0, {}

    def __call__(self, request_id: str | None) -> str | None:
        if request_id is None:
            return None
        if request_id not in self._seen:
            for offset, line in conductor_log.lines(self._log, self._offset):
                if not line.endswith("\n"):  # still being written: read again next time
                    break
                self._offset = offset + len(line.encode())
                event, kv = conductor_log.parse(line)
                rid = kv.get("client_request_id") or kv.get("request_id")
                if event == "timeline" and rid and "decode" in kv:
                    self._seen[rid] = kv["decode"]
        return self._seen.get(request_id)


def _wait_instances(c: EmbeddedCluster, n: int, timeout: float) -> None:
    """Until `n` instances serve (the conductor's /health needs only one of each role)."""
    from protos import admin_pb2, admin_pb2_grpc

    md = (("authorization", f"Bearer {c.token_file.read_text().strip()}"),)
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(c.admin_addr) as ch:
        stub = admin_pb2_grpc.AdminStub(ch)
        while time.monotonic() < deadline:
            reply = stub.ListInstances(admin_pb2.ListInstancesRequest(), metadata=md, timeout=10)
            if sum(i.state == "serving" for i in reply.instances) >= n:
                return
            time.sleep(1.0)
    raise TimeoutError(f"{n} instances not ready after {timeout:.0f}s (logs in {c.run_dir})")


def _tokenizer(model: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


# --------------------------------------------------------------------------- vLLM servers


def _vllm_serve(name: str, e: Engines, run_dir: Path, kv_cache_bytes: int,
                connector: dict | None, threads: int) -> tuple[ManagedProcess, str]:
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", e.model, "--served-model-name", e.served_name,
            "--host", "127.0.0.1", "--port", str(port),
            "--dtype", e.dtype, "--block-size", str(e.block_size),
            "--max-model-len", str(e.max_model_len),
            "--kv-cache-memory-bytes", str(kv_cache_bytes),
            "--max-num-seqs", str(e.max_num_seqs),
            "--enable-prefix-caching"]
    if connector is not None:
        argv += ["--kv-transfer-config", json.dumps(connector)]
    env = {**_engine_env(), **e.env(threads)}
    env.pop(IPC_ENV, None)  # a directory of its own for what vLLM leaves behind
    proc = ManagedProcess(name, argv, run_dir / f"{name}.log", env=env,
                          cwd=str(Path(__file__).resolve().parents[2]),
                          scratch=vllm_scratch(env)).start()
    return proc, f"http://127.0.0.1:{port}"


def _stop_all(procs: list[ManagedProcess], master: StoreMaster | None = None,
              holder: StoreClientService | None = None) -> None:
    for p in reversed(procs):
        try:
            p.stop(timeout=20.0)
        except Exception:  # stop the rest whatever one does
            p.kill()
    if holder is not None:
        holder.stop()
    if master is not None:
        master.stop()


class LeanHttp:
    """One keep-alive HTTP/1.1 connection (the standard library's `http.client`), for latency
    probes: its own cost is close to the gRPC client's the direct calls use. httpx spent
    0.4-0.6 ms more per request against a do-nothing server, and 1.1-1.5 ms more through the
    conductor with engines on both cores: a cost of the client, not of what it measures."""

    def __init__(self, url: str) -> None:
        host, _, port = url.split("://", 1)[1].rstrip("/").partition(":")
        self._conn = http.client.HTTPConnection(host, int(port or 80), timeout=60)

    def post(self, path: str, body: dict) -> tuple[float, str | None]:
        """Seconds to the whole answer, and its X-Request-Id; raises on a status other than
        200."""
        data = json.dumps(body).encode()
        t0 = time.perf_counter()
        self._conn.request("POST", path, data, {"Content-Type": "application/json"})
        r = self._conn.getresponse()
        payload = r.read()
        t = time.perf_counter() - t0
        if r.status != 200:
            raise RuntimeError(f"POST {path}: {r.status} {payload[:200]!r}")
        return t, r.getheader("x-request-id")

    def close(self) -> None:
        self._conn.close()


def _http_direct(url: str, model: str) -> Callable[[str, str | None], float]:
    client = LeanHttp(url)

    def direct(prompt: str, _through_id: str | None) -> float:
        return client.post("/v1/completions", {
            "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})[0]
    return direct


def _start_router(run_dir: Path, procs: list[ManagedProcess], *args: str) -> str:
    """vllm-router on a free loopback port with `args`, added to `procs` once started; its
    URL, when it answers /health."""
    port = free_port()
    argv = [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1",
            "--port", str(port), *args]
    procs.append(ManagedProcess("vllm-router", argv, run_dir / "vllm-router.log").start())
    url = f"http://127.0.0.1:{port}"
    _wait_http(f"{url}/health", procs, 120, "vllm-router")
    return url


def vllm_router(e: Engines, run_dir: Path) -> Running:
    run_dir.mkdir(parents=True, exist_ok=True)
    master = StoreMaster(log_path=run_dir / "mooncake_master.log").start()
    procs: list[ManagedProcess] = []
    holder: StoreClientService | None = None
    try:
        if e.pool_shm:  # as our cluster's --pool-shm does
            n = e.prefill + e.decode
            holder = StoreClientService(master, segment=f"{n * e.pool_segment_bytes >> 20}MB",
                                        log_path=run_dir / "mooncake_client.log").start()

        def connector(role: str) -> dict:
            extra = {"master_addr": master.master_addr, "metadata_url": master.metadata_url,
                     "namespace": kv_namespace(e.model, e.block_size, e.dtype),
                     "segment_bytes": e.pool_segment_bytes, "local_host": "127.0.0.1"}
            if holder is not None:
                extra |= {"store_client": holder.address,
                          "store_client_segment": holder.segment_name}
            return {"kv_connector": "PoolConnector", "kv_connector_module_path": "store.connector",
                    "kv_role": role, "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": extra}
        prefills, decodes = [], []
        for i in range(e.prefill):
            p, url = _vllm_serve(f"vllm-prefill-{i}", e, run_dir, e.kv_cache_bytes,
                                 connector("kv_both"), e.threads)
            procs.append(p)
            prefills.append(url)
        for i in range(e.decode):
            p, url = _vllm_serve(f"vllm-decode-{i}", e, run_dir, e.kv_cache_bytes,
                                 connector("kv_both"), e.threads)
            procs.append(p)
            decodes.append(url)
        for url in prefills + decodes:
            _wait_http(f"{url}/health", procs, 600, "a vLLM server")
        url = _start_router(run_dir, procs, "--vllm-pd-disaggregation",
                            *(a for u in prefills for a in ("--prefill", u)),
                            *(a for u in decodes for a in ("--decode", u)))
    except BaseException:
        _stop_all(procs, master, holder)
        raise
    return Running("vllm_router", url, e.served_name, lambda: _stop_all(procs, master, holder),
                   _http_direct(decodes[0], e.served_name), run_dir)


def vllm_router_dp(e: Engines, run_dir: Path) -> Running:
    """vllm-router's regular mode over one colocated `vllm serve` per core, the KV memory
    shared out, one OpenMP thread each."""
    run_dir.mkdir(parents=True, exist_ok=True)
    n = max(1, e.cores)
    kv = e.kv_cache_bytes * (e.prefill + e.decode) // n
    procs: list[ManagedProcess] = []
    urls: list[str] = []
    try:
        for i in range(n):
            p, url = _vllm_serve(f"vllm-dp-{i}", e, run_dir, kv, None, 1)
            procs.append(p)
            urls.append(url)
        for url in urls:
            _wait_http(f"{url}/health", procs, 600, "a vLLM server")
        url = _start_router(run_dir, procs, "--policy", "cache_aware", "--worker-urls", *urls)
    except BaseException:
        _stop_all(procs)
        raise
    return Running("vllm_router_dp", url, e.served_name, lambda: _stop_all(procs),
                   _http_direct(urls[0], e.served_name), run_dir)


def colocated(e: Engines, run_dir: Path) -> Running:
    run_dir.mkdir(parents=True, exist_ok=True)
    kv = e.kv_cache_bytes * (e.prefill + e.decode)
    p, url = _vllm_serve("vllm-colocated", e, run_dir, kv, None, e.cores)
    try:
        _wait_http(f"{url}/health", [p], 600, "the colocated vLLM server")
    except BaseException:
        _stop_all([p])
        raise
    return Running("colocated", url, e.served_name, lambda: _stop_all([p]), None, run_dir)


SYSTEMS = ("kv_centric", "kv_centric_2p2d", "round_robin", "vllm_router", "vllm_router_dp",
           "colocated")


def start(name: str, e: Engines, run_dir: Path, ttft_slo_s: float, tbt_slo_s: float) -> Running:
    if name in ("kv_centric", "round_robin"):
        return ours(name, name, e, run_dir, ttft_slo_s, tbt_slo_s, mooncake_shape=False)
    if name == "kv_centric_2p2d":
        return ours(name, "kv_centric", e, run_dir, ttft_slo_s, tbt_slo_s, mooncake_shape=True)
    if name == "vllm_router":
        return vllm_router(e, run_dir)
    if name == "vllm_router_dp":
        return vllm_router_dp(e, run_dir)
    if name == "colocated":
        return colocated(e, run_dir)
    raise ValueError(f"unknown system {name!r}; one of {SYSTEMS}")
