"""`make bench-kv`: KV blocks through the Mooncake Store pool, against the machine's limits.

Blocks have the benchmark model's real shape (the tiny model's layers, KV heads, head dim, at
block size 32 in float32, laid out as vLLM-CPU lays out its paged cache) and move through the
connector's own data path (`store.kv_transfer.KVTransfer`: registered cache memory, one object
per block holding every layer's slice, dedup check before the put, zero-copy put/get). A
writer process puts, a reader process gets (both `benchmarks.kv_worker`), over Mooncake's TCP
transport on loopback with a real `mooncake_master`; objects live in the writer's own segment
(the connector's setting) or in a third client's (this process, the "pool holder"), where both
directions cross processes.

Measured in the same run, for comparison: raw loopback TCP between two processes (the
transport's limit) and single-threaded memcpy (the memory limit), Mooncake's own
`transfer_engine_bench` (TCP, no store), and the model's prefill time per block on a real
engine (is loading a block cheaper than recomputing it?). Several transfer settings are tried
(where objects live, batch size, threads, Mooncake's TCP knobs, and its shared-memory path:
both processes dummy clients of one standalone `mooncake_client`, their buffers in its shared
memory, every transfer a memcpy inside it). The summary is the connector on that shared-memory
path, the best transport Mooncake 0.3.13 offers for two processes on one host (the
embedded cluster's `--pool-shm`); the connector over TCP (each engine its own segment, the
writer's put a local copy, the reader's get across processes) is printed above it. Last line:

    kv put_gbps=<x> get_gbps=<x> tcp_gbps=<x> memcpy_gbps=<x> get_vs_tcp=<r> put_vs_tcp=<r>

GB/s are 1e9 bytes per second.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.kv_worker import BLOCK_SIZE, DTYPE, MiB, Shape, Worker
from benchmarks.machine import cpu_model
from cluster.process import vllm_scratch_here
from cluster.signals import stop_on_signals

GB = 1e9
ROOT = Path(__file__).resolve().parent.parent


def say(msg: str) -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------------------ model shape


def model_shape(model: str) -> Shape:
    cfg = json.loads(Path(model, "config.json").read_text())
    heads = cfg["num_attention_heads"]
    return Shape(layers=cfg["num_hidden_layers"],
                 kv_heads=cfg.get("num_key_value_heads", heads),
                 head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads)


# ------------------------------------------------------------------------------ limits


def measure_memcpy(nbytes: int = 256 * MiB, repeats: int = 5) -> float:
    """Single-threaded copy of a large buffer (numpy), best of `repeats`, in GB/s."""
    import numpy as np

    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / GB


_TCP_SENDER = """
import socket, sys
port, total, chunk = map(int, sys.argv[1:4])
buf = memoryview(bytearray(b"x" * chunk))
s = socket.create_connection(("127.0.0.1", port))
sent = 0
while sent < total:
    s.sendall(buf)
    sent += chunk
s.shutdown(socket.SHUT_WR)
s.recv(1)
s.close()
"""


def measure_tcp(total: int = 1 << 30, chunk: int = 4 * MiB, repeats: int = 3) -> float:
    """Loopback TCP between two processes: socket sendall / recv_into of `chunk`-sized
    buffers, best of `repeats`, in GB/s."""
    best = 0.0
    for _ in range(repeats):
        srv = socket.create_server(("127.0.0.1", 0))
        port = srv.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-c", _TCP_SENDER, str(port), str(total),
                                 str(chunk)])
        conn, _ = srv.accept()
        buf = memoryview(bytearray(chunk))
        got = 0
        t0 = time.perf_counter()
        while got < total:
            n = conn.recv_into(buf)
            if not n:
                break
            got += n
        dt = time.perf_counter() - t0
        conn.sendall(b"k")
        conn.close()
        srv.close()
        proc.wait(timeout=30)
        best = max(best, got / dt / GB)
    return best


# ------------------------------------------------------------------------------ settings


@dataclass
class Setting:
    name: str
    batch: int
    threads: int
    env: dict[str, str] = field(default_factory=dict)
    get_batch: int = 0
    """Blocks per get call (0: `batch`). The connector loads a request's whole hit in one call."""
    staging_blocks: int = 0
    """The reader's `KVTransfer(staging_blocks=...)` (the connector's `load_staging_blocks`)."""
    own_segment: bool = False
    """The writer puts into its own segment (`prefer_local_segment`, as the connector does);
    otherwise objects go to the holder's, and both put and get cross processes."""
    store_client: bool = False
    """Writer and reader are Mooncake dummy clients of a standalone `mooncake_client` that owns
    the segment; their caches live in shared memory it maps: put and get are memcpys there."""
    checksum: bool = False
    """Every object carries its block's digest, verified on load (`store.checksum`)."""


@dataclass
class Result:
    setting: Setting
    put_gbps: float
    get_gbps: float
    identical: bool
    get_latency_s: float = 0.0
    get_flat_gbps: float = 0.0
    """The same objects read into one contiguous range each instead of one per layer."""


def run_setting(s: Setting, shape: Shape, blocks: int, rounds: int, master) -> Result:
    service = None
    if s.store_client:
        from store.master import StoreClientService

        service = StoreClientService(master, segment="1GB").start()
    addr = f"{service.address},{service.segment_name}" if service else ""
    try:
        return _run_setting(s, shape, blocks, rounds, master, addr)
    finally:
        if service is not None:
            service.stop()


def _run_setting(s: Setting, shape: Shape, blocks: int, rounds: int, master,
                 store_client: str) -> Result:
    writer = Worker("writer", shape, blocks, master, s.env, s.threads, s.own_segment,
                    store_client=store_client, checksum=s.checksum)
    reader = Worker("reader", shape, blocks, master, s.env, s.threads,
                    staging_blocks=s.staging_blocks, store_client=store_client,
                    checksum=s.checksum)
    nbytes = blocks * shape.block_bytes
    puts, gets, flats, identical, latency = [], [], [], True, 0.0
    try:
        for r in range(rounds + 1):  # round 0 warms the connections up, not counted
            prefix = f"bench/{uuid.uuid4().hex[:8]}"
            p = writer.ask(op="put", prefix=prefix, batch=s.batch, threads=s.threads)
            g = reader.ask(op="get", prefix=prefix, batch=s.get_batch or s.batch,
                           threads=s.threads)
            if p["ok"] != blocks or g["ok"] != blocks:
                raise RuntimeError(f"{s.name}: put {p['ok']}/{blocks}, got {g['ok']}/{blocks}")
            identical &= g["identical"]
            # the probe reads plain objects (a digested one is longer)
            f = None if s.checksum else reader.ask(op="get_flat", prefix=prefix,
                                                   batch=s.get_batch or s.batch)
            if r == rounds:
                latency = reader.ask(op="latency", prefix=prefix)["median_s"]
            writer.ask(op="remove", prefix=prefix)
            if r:
                puts.append(nbytes / p["seconds"] / GB)
                gets.append(nbytes / g["seconds"] / GB)
                if f is not None:
                    flats.append(nbytes / f["seconds"] / GB)
    finally:
        writer.close()
        reader.close()
    return Result(s, statistics.median(puts), statistics.median(gets), identical, latency,
                  statistics.median(flats) if flats else 0.0)


# ------------------------------------------------------------------------------ Mooncake's own


def transfer_engine_bench(master, seconds: int = 2) -> str | None:
    """Mooncake's `transfer_engine_bench` over TCP (no store), if the wheel ships it: the
    transport's own ceiling on this machine. Returns its throughput line or None."""
    import mooncake

    binary = Path(mooncake.__file__).parent / "transfer_engine_bench"
    if not binary.is_file():
        return None
    from cluster.ports import free_port

    tport, iport = free_port(), free_port()
    meta = master.metadata_url
    common = [f"--metadata_server={meta}", "--protocol=tcp", "--buffer_size=268435456",
              "--report_unit=GB"]
    env = {**os.environ, "GLOG_logtostderr": "1"}
    target = subprocess.Popen([str(binary), "--mode=target",
                               f"--local_server_name=127.0.0.1:{tport}", *common],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.5)
        best = None
        for op in ("write", "read"):
            out = subprocess.run(
                [str(binary), "--mode=initiator", f"--local_server_name=127.0.0.1:{iport}",
                 f"--segment_id=127.0.0.1:{tport}", f"--operation={op}",
                 f"--duration={seconds}", "--threads=2", "--batch_size=64",
                 "--block_size=1048576", *common],
                env=env, capture_output=True, text=True, timeout=seconds + 30)
            lines = [ln for ln in (out.stdout + out.stderr).splitlines()
                     if "throughput" in ln.lower()]
            if lines:
                line = lines[-1].split("]")[-1].strip()
                best = f"{best}; {op}: {line}" if best else f"{op}: {line}"
        return best
    except (OSError, subprocess.SubprocessError):
        return None
    finally:
        target.kill()
        target.wait()


# ------------------------------------------------------------------------------ recompute


def prefill_seconds_per_block(model: str, tokens: int = 1024) -> float:
    """A real engine's prefill time per block of `BLOCK_SIZE` tokens (no prefix caching,
    median of 5 prompts of `tokens` tokens, after a warm-up)."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams

    with vllm_scratch_here():  # the engine's socket files go with it
        llm = LLM(model=model, block_size=BLOCK_SIZE, dtype=DTYPE, max_model_len=2048,
                  enforce_eager=True, kv_cache_memory_bytes=128 * MiB,
                  enable_prefix_caching=False, disable_log_stats=True)
        params = SamplingParams(max_tokens=1, temperature=0.0)
        times = []
        for i in range(6):
            prompt = [(7 * i + 13 * j) % 2000 + 3 for j in range(tokens)]
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            if i:
                times.append(time.perf_counter() - t0)
        llm.llm_engine.engine_core.shutdown()
    return statistics.median(times) / (tokens / BLOCK_SIZE)


# ------------------------------------------------------------------------------ main


SETTINGS = [
    Setting("connector: writer's segment, put 64 / get 256 blocks per call", 64, 1,
            get_batch=256, own_segment=True),
    Setting("holder's segment, 64 blocks per call", 64, 1),
    Setting("holder's segment, 256 blocks per call", 256, 1),
    Setting("holder's segment, 64 blocks per call, 4 threads", 64, 4),
    Setting("connector + MC_TCP_LANES_PER_PEER=16", 64, 1, {"MC_TCP_LANES_PER_PEER": "16"},
            get_batch=256, own_segment=True),
    Setting("connector + load_staging_blocks=256", 64, 1, get_batch=256, own_segment=True,
            staging_blocks=256),
    Setting("connector + checksum", 64, 1, get_batch=256, own_segment=True, checksum=True),
    Setting("shm + checksum", 64, 1, get_batch=256, store_client=True, checksum=True),
    Setting("shm: dummy clients of one mooncake_client, put 64 / get 256", 64, 1,
            get_batch=256, store_client=True),
]
"""Mooncake 0.3.13's TCP transport: `MC_TCP_LANES_PER_PEER` connections per peer (default 4),
`MC_TCP_SLICE_SIZE` bytes per slice (default 64 KiB). `MC_STORE_MEMCPY` is auto-enabled on
TCP-only hosts but only short-cuts transfers to a segment in the same process."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_kv",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default=os.environ.get("KVCLUSTER_MODEL", ""),
                   help="local HF model directory (default: the built-in tiny model)")
    p.add_argument("--blocks", type=int, default=1024, help="blocks per round (and per cache)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-engine", action="store_true", help="skip the prefill measurement")
    p.add_argument("--quick", action="store_true", help="only the first and best-known setting")
    p.add_argument("--only", default="", help="comma-separated indexes of the settings to run")
    args = p.parse_args(argv)
    stop_on_signals()

    t_start = time.perf_counter()
    os.environ.setdefault("GLOG_minloglevel", "1")  # Mooncake's INFO lines, here and in children
    from importlib.metadata import version

    from store.master import StoreMaster
    from store.pool import MooncakePool, PoolConfig

    if not args.model:
        from tinymodel.builder import ensure_model

        args.model = str(ensure_model())
    shape = model_shape(args.model)
    nbytes = args.blocks * shape.block_bytes
    try:
        mc_version = version("mooncake-transfer-engine-non-cuda")
    except Exception:
        mc_version = version("mooncake-transfer-engine")
    say(f"machine: {cpu_model()}, {os.cpu_count()} logical CPUs, {platform.machine()}, "
        f"Python {platform.python_version()}, mooncake {mc_version}; load average "
        f"{os.getloadavg()[0]:.1f} at start (other jobs share the cores if above ~0.5)")
    say(f"model: {args.model}")
    say(f"block: {shape.describe()}")
    say(f"round: {args.blocks} blocks = {nbytes / MiB:.0f} MiB, {args.rounds} rounds + 1 warm-up"
        " per setting; writer process -> pool -> reader process, all on 127.0.0.1")

    say("memcpy (numpy, 1 thread, 256 MiB)...")
    memcpy = measure_memcpy()
    say(f"  memcpy {memcpy:.2f} GB/s")
    say("raw loopback TCP between two processes (1 GiB in 4 MiB sendall/recv_into)...")
    tcp = measure_tcp()
    say(f"  tcp {tcp:.2f} GB/s")

    settings = [SETTINGS[0], SETTINGS[-1]] if args.quick else SETTINGS
    if args.only:
        settings = [SETTINGS[int(i)] for i in args.only.split(",")]
    results: list[Result] = []
    master = StoreMaster(eviction_ratio=0.0, eviction_high_watermark_ratio=1.0)
    with master:
        holder = MooncakePool(PoolConfig(master_addr=master.master_addr,
                                         metadata_url=master.metadata_url,
                                         segment_bytes=nbytes + 64 * MiB))
        try:
            for s in settings:
                say(f"setting: {s.name} ...")
                r = run_setting(s, shape, args.blocks, args.rounds, master)
                results.append(r)
                probe = (f"  (probe: get into one range per block {r.get_flat_gbps:.2f} GB/s)"
                         if r.get_flat_gbps else "")
                say(f"  put {r.put_gbps:.2f} GB/s  get {r.get_gbps:.2f} GB/s  "
                    f"bytes identical: {r.identical}  1-block get latency "
                    f"{r.get_latency_s * 1e3:.2f} ms{probe}")
        finally:
            holder.close()
        say("Mooncake transfer_engine_bench (TCP, 1 MiB blocks, 2 threads, no store)...")
        te = transfer_engine_bench(master)
        say(f"  {te or 'not available'}")

    best = max(results, key=lambda r: min(r.put_gbps, r.get_gbps))
    tcp_default = results[0]  # the connector over TCP
    # the summary: the connector on the shared-memory path where it ran, else over TCP
    default = next((r for r in results if r.setting.store_client and not r.setting.checksum),
                   tcp_default)
    load_block_s = shape.block_bytes / (default.get_gbps * GB)
    say(f"best setting: {best.setting.name} {best.setting.env or ''}; the summary line is "
        f"{default.setting.name}")
    if not args.no_engine:
        say("prefill on a real engine (no prefix caching, 1024-token prompts)...")
        per_block = prefill_seconds_per_block(args.model)
        lone = default.get_latency_s
        say(f"  recompute {per_block * 1e3:.3f} ms per block; load {load_block_s * 1e3:.3f} ms "
            f"per block in bulk ({per_block / load_block_s:.1f}x faster than recompute), "
            f"{lone * 1e3:.2f} ms for a lone block ({per_block / lone:.1f}x): loading wins "
            f"{'from the first block' if lone < per_block else 'only for longer prefixes'}")
    for r in results:
        say(f"  {r.setting.name:48s} put {r.put_gbps:5.2f}  get {r.get_gbps:5.2f} GB/s  "
            f"put/tcp {r.put_gbps / tcp:.2f}  get/tcp {r.get_gbps / tcp:.2f}")
    for plain in (tcp_default, default):
        summed = next((r for r in results if r.setting.checksum
                       and r.setting.store_client == plain.setting.store_client), None)
        if summed is not None:
            say(f"checksum cost ({'shm' if plain.setting.store_client else 'TCP'}): put "
                f"{summed.put_gbps / plain.put_gbps:.2f}x, get "
                f"{summed.get_gbps / plain.get_gbps:.2f}x the throughput without")
    t = tcp_default
    say(f"connector over TCP: put {t.put_gbps:.2f} get {t.get_gbps:.2f} GB/s (put/tcp "
        f"{t.put_gbps / tcp:.2f}, get/tcp {t.get_gbps / tcp:.2f}); summary setting: put "
        f"{default.put_gbps:.2f} get {default.get_gbps:.2f} GB/s; "
        f"memcpy/tcp {memcpy / tcp:.2f}; load average {os.getloadavg()[0]:.1f} at end; "
        f"total {time.perf_counter() - t_start:.0f} s")
    if not all(r.identical for r in results):
        say("ERROR: a reader got different bytes than the writer put")
        return 1
    say(f"kv put_gbps={default.put_gbps:.2f} get_gbps={default.get_gbps:.2f} tcp_gbps={tcp:.2f} "
        f"memcpy_gbps={memcpy:.2f} get_vs_tcp={default.get_gbps / tcp:.2f} "
        f"put_vs_tcp={default.put_gbps / tcp:.2f}")
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "bench-kv"
    sys.exit(main())
