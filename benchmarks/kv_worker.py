"""bench-kv's writer and reader processes, and the handle that drives one.

A worker holds one KV cache of the benchmark model's shape, connected to the pool through the
connector's own data path (`store.kv_transfer.KVTransfer`), and answers commands sent as JSON
lines on stdin (`put`, `get`, `get_flat`, `latency`, `remove`, `quit`) with one `REPLY <json>`
line each. `python -m benchmarks.kv_worker writer|reader ...`, started by `Worker`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from cluster.signals import stop_on_signals

MiB = 1 << 20
BLOCK_SIZE = 32
DTYPE = "float32"
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Shape:
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int = BLOCK_SIZE
    dtype: str = DTYPE

    @property
    def block_bytes(self) -> int:
        return self.layers * self.kv_heads * self.block_size * 2 * self.head_dim * 4

    def describe(self) -> str:
        return (f"{self.layers} layers x {self.kv_heads} KV heads x head_dim {self.head_dim}, "
                f"block {self.block_size} tokens, {self.dtype}: {self.block_bytes // 1024} KiB "
                f"per block ({self.block_bytes // self.layers // 1024} KiB per layer slice)")


def serve(args: argparse.Namespace) -> None:
    """A writer or reader: one KV cache of `blocks` blocks, commands as JSON lines on stdin."""
    import torch

    from store.kv_transfer import BlockLayout, KVTransfer
    from store.pool import MooncakePool, PoolConfig

    torch.set_num_threads(1)
    shape = Shape(args.layers, args.kv_heads, args.head_dim)
    gen = torch.Generator().manual_seed(1234)
    layers = [torch.randn(args.blocks, shape.kv_heads, shape.block_size, 2 * shape.head_dim,
                          generator=gen) for _ in range(shape.layers)]
    expected = None
    if args.role == "reader":
        expected = layers
        layers = [torch.zeros_like(t) for t in expected]
    segment = args.blocks * shape.block_bytes + 64 * MiB if args.own_segment else 0
    client = args.store_client.split(",")  # address,segment (or "")
    pool = MooncakePool(PoolConfig(master_addr=args.master, metadata_url=args.metadata,
                                   segment_bytes=segment, op_timeout_s=30.0,
                                   prefer_local_segment=args.own_segment or bool(args.store_client),
                                   store_client=client[0], store_client_segment=client[-1]),
                        io_threads=max(4, args.max_threads))
    if args.store_client:
        # The cache in memory the standalone client maps (as the connector's
        # get_mem_pool_context makes vLLM allocate it): one backing buffer, per-layer views.
        import ctypes

        per_layer = args.blocks * shape.block_bytes // shape.layers
        addr = pool.alloc_shared(per_layer * shape.layers)
        raw = torch.frombuffer((ctypes.c_uint8 * (per_layer * shape.layers)).from_address(addr),
                               dtype=torch.uint8)
        backed = [raw[i * per_layer:(i + 1) * per_layer].view(torch.float32).view(t.shape)
                  for i, t in enumerate(layers)]
        for b, t in zip(backed, layers, strict=True):
            b.copy_(t)
        layers = backed
    transfer = KVTransfer(BlockLayout.of(layers, args.blocks), lambda: pool,
                          staging_blocks=args.staging_blocks, checksum=args.checksum)
    assert transfer.connect()
    flat = None
    if args.role == "reader":  # for the transport probe: one contiguous range per object
        if args.store_client:
            import ctypes

            n = args.blocks * shape.block_bytes
            flat = torch.frombuffer((ctypes.c_uint8 * n).from_address(pool.alloc_shared(n)),
                                    dtype=torch.float32).view(args.blocks, -1)
        else:
            flat = torch.zeros(args.blocks, shape.block_bytes // 4)
        pool.register_memory(flat.data_ptr(), args.blocks * shape.block_bytes)
    print("READY", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        keys = [f"{cmd['prefix']}/{i}" for i in range(args.blocks)]
        ids = list(range(args.blocks))
        batch, threads = cmd.get("batch", 64), cmd.get("threads", 1)
        chunks = [(keys[i:i + batch], ids[i:i + batch]) for i in range(0, len(keys), batch)]
        reply: dict = {}
        if cmd["op"] in ("put", "get"):
            fn = transfer.save if cmd["op"] == "put" else transfer.load
            t0 = time.perf_counter()
            with ThreadPoolExecutor(threads) as ex:
                results = list(ex.map(fn, [c[0] for c in chunks], [c[1] for c in chunks]))
            reply["seconds"] = time.perf_counter() - t0
            if cmd["op"] == "put":
                reply["ok"] = sum(r.written for r in results)
            else:
                reply["ok"] = sum(sum(r) for r in results)
                assert expected is not None
                reply["identical"] = all(torch.equal(a, b) for a, b in zip(expected, layers,
                                                                          strict=True))
                for t in layers:
                    t.zero_()
        elif cmd["op"] == "get_flat":  # not the connector's path: a probe of the transport
            assert flat is not None
            t0 = time.perf_counter()
            ok = 0
            for i in range(0, args.blocks, batch):
                ok += sum(pool.get_into(keys[i:i + batch], [
                    [(flat[b].data_ptr(), shape.block_bytes)] for b in ids[i:i + batch]]))
            reply["seconds"] = time.perf_counter() - t0
            reply["ok"] = ok
        elif cmd["op"] == "latency":  # one block per call: the small-load floor
            times = []
            for i in range(min(50, args.blocks)):
                t0 = time.perf_counter()
                transfer.load(keys[i:i + 1], ids[i:i + 1])
                times.append(time.perf_counter() - t0)
            reply["median_s"] = statistics.median(times)
        elif cmd["op"] == "remove":
            reply["removed"] = pool.remove(keys, force=True)
        print("REPLY " + json.dumps(reply), flush=True)
    pool.close()


class Worker:
    def __init__(self, role: str, shape: Shape, blocks: int, master, env: dict[str, str],
                 max_threads: int, own_segment: bool = False, staging_blocks: int = 0,
                 store_client: str = "", checksum: bool = False) -> None:
        argv = [sys.executable, "-m", "benchmarks.kv_worker", role,
                "--layers", str(shape.layers), "--kv-heads", str(shape.kv_heads),
                "--head-dim", str(shape.head_dim), "--blocks", str(blocks),
                "--master", master.master_addr, "--metadata", master.metadata_url,
                "--max-threads", str(max_threads), "--staging-blocks", str(staging_blocks),
                "--store-client", store_client,
                ] + (["--own-segment"] if own_segment else []) \
            + (["--checksum"] if checksum else [])
        full_env = {**os.environ, **env, "PYTHONPATH": str(ROOT), "GLOG_minloglevel": "2"}
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=full_env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL)
        self._expect("READY")

    def _expect(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"bench worker exited ({self.proc.wait()})")
            if line.startswith(prefix):
                return line[len(prefix):].strip()

    def ask(self, **cmd) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._expect("REPLY "))

    def close(self) -> None:
        try:
            self.ask(op="quit")
        except (RuntimeError, BrokenPipeError, json.JSONDecodeError):
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_worker",
                                description=__doc__.split("\n")[0])
    p.add_argument("role", choices=("writer", "reader"))
    for name in ("--layers", "--kv-heads", "--head-dim", "--blocks", "--max-threads",
                 "--staging-blocks"):
        p.add_argument(name, type=int, required=name != "--staging-blocks", default=0)
    p.add_argument("--own-segment", action="store_true")
    p.add_argument("--checksum", action="store_true")
    p.add_argument("--master", required=True)
    p.add_argument("--metadata", required=True)
    p.add_argument("--store-client", default="",
                   help="a standalone mooncake_client's address,segment (shared memory)")
    args = p.parse_args(argv)
    stop_on_signals()
    serve(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
