"""`python -m embedded` (what `make run` calls): its flags, the `ClusterSpec` they make, and
the loop that keeps the cluster running until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time

from cluster import loopback, shape
from cluster.signals import stop_on_signals
from embedded.launcher import ClusterSpec, EmbeddedCluster
from embedded.supervisor import QUICK_DEATHS, QUICK_S, GaveUp, RestartPolicy
from worker.dtype import DTYPES


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvcluster", description="Run the embedded cluster.")
    p.add_argument("--model", default=os.environ.get("KVCLUSTER_MODEL", ""),
                   help="local HF model directory (default: the built-in tiny model)")
    p.add_argument("--port", type=int, default=int(os.environ.get("KVCLUSTER_PORT", "8000")))
    p.add_argument("--conductors", type=int, default=1,
                   help="conductor replicas serving the one cluster, on --port and the next "
                   "free ports above it (their admin APIs likewise above --admin-port)")
    p.add_argument("--conductor-restarts", type=int,
                   default=QUICK_DEATHS,
                   help="a conductor that exits is started again (after a pause that doubles "
                   f"while it keeps dying within {QUICK_S} s of its start); "
                   "after this many such quick deaths in a row the launcher gives up and stops")
    p.add_argument("--prefill", type=int, default=None,
                   help="prefill engines (with --decode/--both: this shape instead of the one "
                   "chosen for the machine)")
    p.add_argument("--decode", type=int, default=None, help="decode engines")
    p.add_argument("--both", type=int, default=None,
                   help="engines in the both role (the conductor decides per request)")
    p.add_argument("--disaggregate", choices=("auto", "always", "never"), default="auto",
                   help="kv_centric: prefill on another engine per the models (auto), "
                   "whenever possible (always), or never")
    p.add_argument("--policy", default="kv_centric")
    p.add_argument("--eager", action="store_true",
                   help="engines in eager mode: up in ~20 s instead of ~60 s, each step slower")
    p.add_argument("--step-tokens", type=int, default=None,
                   help="tokens a CPU engine that decodes computes per step (vLLM's "
                   "max_num_batched_tokens): a prompt is prefilled in chunks between its "
                   f"streams' tokens (default: {shape.STEP_TOKENS_PER_THREAD} per thread; 0: "
                   "vLLM's 2048)")
    p.add_argument("--etcd-port", type=int, default=0)
    p.add_argument("--store-rpc-port", type=int, default=0)
    p.add_argument("--store-metadata-port", type=int, default=0)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="the engines' dtype (auto: as vllm serve picks it, bfloat16 on a CPU "
                   "that has it)")
    p.add_argument("--admin-port", type=int,
                   default=int(os.environ.get("KVCLUSTER_ADMIN_PORT", "8001")),
                   help="the conductor's admin API on 127.0.0.1 (0: a free port, -1: off)")
    p.add_argument("--run-dir", default=os.environ.get("KVCLUSTER_RUN_DIR", "run"))
    p.add_argument("--pool", choices=("shm", "tcp"),
                   default=os.environ.get("KVCLUSTER_POOL", "shm"),
                   help="the pool's transport: one mooncake_client's shared memory (memcpy; "
                   "the default on one host) or each engine's TCP segment (as across hosts)")
    p.add_argument("--worker-tls", action="store_true",
                   default=os.environ.get("KVCLUSTER_WORKER_TLS", "") == "1",
                   help="the conductor's calls to the workers over mutual TLS (certificates "
                   "made in <run-dir>/worker-tls)")
    p.add_argument(loopback.OPT_OUT, action="store_true",
                   default=os.environ.get("KVCLUSTER_ALLOW_WILDCARD_BINDS", "") == "1",
                   help="start even where Mooncake's servers cannot be kept on 127.0.0.1 (no "
                   "C compiler for the bind shim, cluster/loopback.py): they then listen on "
                   "every address. Without it such a start is refused")
    return p


def spec_from_args(argv: list[str] | None = None) -> ClusterSpec:
    """The cluster `python -m embedded ARGV` (and so `make run`) starts."""
    from tinymodel.builder import ensure_model

    a = parser().parse_args(argv)
    model = a.model or str(ensure_model())
    try:
        plan = shape.choose(shape.machine_cores(), _gpus(), a.prefill, a.decode, a.both,
                            a.step_tokens)
        restarts = RestartPolicy(quick_deaths=a.conductor_restarts)
        return ClusterSpec(model=model, prefill=plan.count("prefill"), decode=plan.count("decode"),
                           both=plan.count("both"), shape=plan, http_port=a.port,
                           etcd_port=a.etcd_port, store_rpc_port=a.store_rpc_port,
                           store_metadata_port=a.store_metadata_port, run_dir=a.run_dir,
                           block_size=a.block_size, max_model_len=a.max_model_len,
                           dtype=a.dtype, admin_port=a.admin_port, pool_shm=a.pool == "shm",
                           policy=a.policy,
                           conductor_args=("--disaggregate", a.disaggregate),
                           enforce_eager=a.eager, worker_tls=a.worker_tls,
                           allow_wildcard_binds=a.allow_wildcard_binds,
                           conductors=a.conductors, conductor_restarts=restarts)
    except ValueError as e:  # a bad setting: one line naming it, not a traceback
        parser().error(str(e))


def _gpus() -> int:
    """GPUs `nvidia-smi` sees (as the Makefile decides which vLLM build to install)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines()) \
        if out.returncode == 0 else 0


_POLL_S = 0.25
"""How often the launcher looks at its children: a dead conductor is started again this soon
(the first time; `RestartPolicy`)."""


def _banner(cluster: EmbeddedCluster) -> str:
    """Where the cluster serves (every replica), a `curl` line and a `conductorctl` one."""
    name = os.path.basename(cluster.spec.model.rstrip("/"))
    wide = cluster.wide_listeners()
    admin = cluster.admin_addrs
    return (f"\nkvcluster is serving {name} at {', '.join(cluster.urls)}\n"
            f"  shape: {cluster.describe_shape()}\n\n"
            f"  curl {cluster.url}/v1/completions -H 'Content-Type: application/json' \\\n"
            f"    -d '{{\"model\": \"{name}\", \"prompt\": \"The quick brown fox\", "
            f"\"max_tokens\": 16, \"temperature\": 0}}'\n\n"
            + (f"  listening beyond loopback ({loopback.OPT_OUT}): "
               f"{sorted({f'{a}:{p}' for a, p, _ in wide})}\n\n" if wide else "")
            + (f"  conductorctl --addr {admin[0]} instances   "
               f"(token: {cluster.token_file})\n" if admin else "")
            + (f"  admin APIs: {', '.join(admin)}\n" if len(admin) > 1 else "")
            + ("\n" if admin else "")
            + "Ctrl-C stops every process.")


def main(argv: list[str] | None = None) -> int:
    from cluster.logging import configure

    spec = spec_from_args(argv)
    configure("launcher")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cluster = EmbeddedCluster(spec)
    stop_on_signals()
    try:
        print(f"starting the embedded cluster (logs in {cluster.run_dir}/) ...", flush=True)
        try:
            cluster.start()
        except loopback.LoopbackUnavailable as e:
            print(f"kvcluster: {e}", file=sys.stderr, flush=True)
            return 1
        print(_banner(cluster), flush=True)
        while True:
            time.sleep(_POLL_S)
            cluster._check_alive(restart=True)
    except GaveUp as e:
        print(f"kvcluster: {e}\nstopping ...", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
    finally:
        cluster.stop()
        print("stopped.", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
