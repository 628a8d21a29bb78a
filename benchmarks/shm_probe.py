"""Probe: Mooncake Store between two processes on one host, TCP vs the dummy-client shm path.

Modes:
- `real`  : writer and reader are each a RealClient (`setup(..., "tcp", ...)`), the writer
            contributes the segment (as the connector's prefer_local_segment): put is a local
            copy, get crosses processes over Mooncake's TCP transport.
- `dummy` : a standalone `mooncake_client` (RealClient) owns the segment; writer and reader are
            DummyClients (`setup_dummy`) whose buffers come from `alloc_from_mem_pool` (memfd,
            mapped by the real client through the UDS fd-passing IPC). Put and get are RPCs to the
            real client, which memcpys between the mapped shm and its segment (MC_STORE_MEMCPY).

Run: .venv/bin/python -m benchmarks.shm_probe [--modes real,dummy]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time

from benchmarks.bench_kv import measure_memcpy, measure_tcp
from cluster.ports import free_port, wait_for_port
from store.master import StoreMaster

MiB = 1 << 20
GB = 1e9

# (name, object size, ranges per object, objects per round, objects per call)
WORKLOADS = [
    ("kv128K_4x32K", 128 * 1024, 4, 1024, 256),
    ("obj1M", MiB, 1, 256, 64),
    ("obj32M", 32 * MiB, 1, 8, 8),
]
ROUNDS = 3  # first is warm-up


def _view(ptr: int, size: int):
    import numpy as np

    return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(ptr))


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    from mooncake.store import MooncakeDistributedStore

    st = MooncakeDistributedStore()
    total = max(size * n for _, size, _, n, _ in WORKLOADS)
    if args.mode == "dummy":
        rc = st.setup_dummy(0, 16 * MiB, f"127.0.0.1:{args.client_port}")
        assert rc == 0, rc
        ptr = st.alloc_from_mem_pool(total)
        assert ptr, "alloc_from_mem_pool failed"
        buf = _view(ptr, total)
    else:
        seg = 3 << 30 if args.role == "writer" else 0
        rc = st.setup(f"127.0.0.1:{free_port('127.0.0.1')}", args.metadata, seg, 16 * MiB,
                      "tcp", "", args.master)
        assert rc == 0, rc
        arr = np.empty(total + 4096, dtype=np.uint8)
        off = (-arr.ctypes.data) % 4096
        buf = arr[off:off + total]
        ptr = buf.ctypes.data
    rc = st.register_buffer(ptr, total)
    assert rc == 0, f"register_buffer {rc}"
    out = {}
    if args.role == "writer" and args.prefault:
        # touch the segment once (fresh pages fault on first write), then free it
        f = 32 * MiB
        buf[:f] = 1
        t0 = time.perf_counter()
        keys = [f"prefault_{i}" for i in range(args.prefault * 1024 // 32)]
        for k in keys:
            assert st.put_from(k, ptr, f) == 0
        dt = time.perf_counter() - t0
        assert st.remove_all(True) >= 0
        out["prefault_put_gbps"] = round(len(keys) * f / dt / GB, 3)
    for name, size, nranges, n, per_call in WORKLOADS:
        piece = size // nranges
        for r in range(ROUNDS):
            keys = [f"{name}_r{r}_{i}" for i in range(n)]
            if args.role == "writer":
                rng = np.random.default_rng(r)
                buf[: size * n] = rng.integers(0, 255, size * n, dtype=np.uint8)
            else:
                buf[: size * n] = 0
            t0 = time.perf_counter()
            for c in range(0, n, per_call):
                ks = keys[c:c + per_call]
                ptrs = [[ptr + (c + j) * size + k * piece for k in range(nranges)]
                        for j in range(len(ks))]
                sizes = [[piece] * nranges for _ in ks]
                if args.role == "writer":
                    res = st.batch_put_from_multi_buffers(ks, ptrs, sizes)
                    bad = [x for x in res if x != 0]
                else:
                    res = st.batch_get_into_multi_buffers(ks, ptrs, sizes)
                    bad = [x for x in res if x != size]
                assert not bad, (name, r, bad[:3])
            dt = time.perf_counter() - t0
            if args.role == "reader":
                rng = np.random.default_rng(r)
                ok = np.array_equal(buf[: size * n], rng.integers(0, 255, size * n, dtype=np.uint8))
                assert ok, f"{name} round {r}: bytes differ"
            if r > 0:
                out.setdefault(name, []).append(round(size * n / dt / GB, 3))
    print("RESULT " + json.dumps(out), flush=True)
    if args.role == "writer":
        sys.stdin.readline()  # keep the (real-mode) segment alive until the reader is done
    st.close()


def run_mode(mode: str, master: StoreMaster, env: dict[str, str], prefault: int) -> dict:
    procs = []
    client_port = free_port("127.0.0.1")
    try:
        if mode == "dummy":
            rc_bin = os.path.join(os.path.dirname(sys.executable), "..", "lib", "python3.11",
                                  "site-packages", "mooncake", "mooncake_client")
            real = subprocess.Popen(
                [rc_bin, "--host=127.0.0.1", f"--port={client_port}",
                 "--global_segment_size=3GB", "--protocol=tcp",
                 f"--master_server_address={master.master_addr}",
                 f"--metadata_server={master.metadata_url}", "--logtostderr=true"],
                env=env, stdout=subprocess.DEVNULL, stderr=open("/tmp/shm_probe_client.log", "w"))
            procs.append(real)
            assert wait_for_port("127.0.0.1", client_port, 20), "mooncake_client not up"
            time.sleep(0.5)
        base = [sys.executable, "-m", "benchmarks.shm_probe", "--worker", "--mode", mode,
                "--master", master.master_addr, "--metadata", master.metadata_url,
                "--client-port", str(client_port), "--prefault", str(prefault)]
        res = {}
        w = subprocess.Popen(base + ["--role", "writer"], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        procs.append(w)
        for line in w.stdout:
            if line.startswith("RESULT "):
                res["put"] = json.loads(line[7:])
                break
        r = subprocess.run(base + ["--role", "reader"], env=env, capture_output=True, text=True,
                           timeout=120)
        for line in r.stdout.splitlines():
            if line.startswith("RESULT "):
                res["get"] = json.loads(line[7:])
        if "get" not in res:
            res["reader_err"] = r.stderr[-2000:]
        w.stdin.write("\n")
        w.stdin.flush()
        w.wait(timeout=30)
        return res
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--mode", default="dummy")
    ap.add_argument("--role")
    ap.add_argument("--master")
    ap.add_argument("--metadata")
    ap.add_argument("--client-port", type=int)
    ap.add_argument("--modes", default="real,dummy")
    ap.add_argument("--prefault", type=int, default=0, help="GiB of the segment to touch first")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    env = dict(os.environ, GLOG_minloglevel="1")
    print(f"tcp_gbps={measure_tcp():.2f} memcpy_gbps={measure_memcpy():.2f}", flush=True)
    for mode in args.modes.split(","):
        master = StoreMaster(eviction_ratio=0.0, eviction_high_watermark_ratio=1.0).start()
        try:
            t0 = time.perf_counter()
            res = run_mode(mode, master, env, args.prefault)
            print(mode, json.dumps(res), f"({time.perf_counter() - t0:.1f}s)", flush=True)
        finally:
            master.stop()
    print(f"tcp_gbps={measure_tcp():.2f}", flush=True)


if __name__ == "__main__":
    main()
