"""The cluster on the hosts, made with `deploy/` exactly as an operator would on real machines:
each host its own state and log directory (its own disk), node A's cluster secret, etcd
access and worker-plane TLS copied to the others (the operator's `scp -p`), every script run
inside its host's namespace with the environment the README's deploy section gives."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.chaos.config import DTYPE
from tests.hosts import net
from tests.hosts.net import Host

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PORT = 8000
ADMIN = "127.0.0.1:8001"
ENGINE_THREADS = 1
"""OpenMP threads of every engine, and of the reference engine they are compared with exactly."""


@dataclass(frozen=True)
class Worker:
    instance_id: str
    role: str
    host: Host
    cpus: str
    """The core its engine computes on (`KVCLUSTER_WORKER_ENGINE_CPUS`): two cores, three
    engines, given out deliberately."""


class Cluster:
    def __init__(self, a: Host, workers: list[Worker], model: str, run_dir: Path,
                 kv_cache_bytes: int) -> None:
        self.a = a
        self.workers = workers
        self.model = model
        self.run_dir = run_dir
        self.kv_cache_bytes = kv_cache_bytes
        self.url = f"http://{a.addr}:{PORT}"
        self.socket_dirs: list[str] = []
        """Each worker's vLLM socket directory (`cluster.process.IPC_ENV`, `DIST_ENV`), set here
        so that the files of one that stop.sh or the teardown kills go too
        (`remove_socket_dirs`)."""

    def state_dir(self, host: Host) -> Path:
        return self.run_dir / f"host-{host.name.lower()}"

    def env(self, host: Host, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("KVCLUSTER_", "ETCD_", "VLLM_"))}
        env.update(KVCLUSTER_PYTHON=sys.executable,
                   KVCLUSTER_STATE_DIR=str(self.state_dir(host)),
                   KVCLUSTER_LOG_DIR=str(self.state_dir(host)),
                   KVCLUSTER_HOST=host.addr,
                   KVCLUSTER_ETCD=f"{self.a.addr}:2379",
                   KVCLUSTER_POOL_MASTER=f"{self.a.addr}:50051",
                   KVCLUSTER_POOL_METADATA=f"http://{self.a.addr}:8080/metadata",
                   KVCLUSTER_MODEL=self.model,
                   KVCLUSTER_ETCD_SECURE="1", KVCLUSTER_WORKER_TLS="1")
        env.update(extra)
        return env

    def script(self, host: Host, name: str, *args: str, timeout: float = 120.0,
               **extra: str) -> str:
        """Run deploy/<name> on `host`; its output, or an error with it."""
        p = net.run(str(DEPLOY / name), *args, ns=host.ns, env=self.env(host, **extra),
                    timeout=timeout)
        return p.stdout + p.stderr

    def start_node_a(self) -> None:
        """etcd (TLS, client certificates and auth: `KVCLUSTER_ETCD_SECURE=1`), the pool's
        master, the conductor. The conductor always disaggregates
        (Mooncake's shape), so that every prompt crosses from B's prefill to a decode, and
        its decodes wait up to 10 s more than predicted for the prefill's blocks (0.5 s by
        default): a prefill slowed past that on a busy machine would be computed again by
        the decode, and the blocks the run checks were loaded across hosts would not be."""
        self.script(self.a, "etcd.sh")
        self.script(self.a, "store_master.sh")
        self.script(self.a, "conductor.sh", KVCLUSTER_CONDUCTOR_DISAGGREGATE="always",
                    KVCLUSTER_CONDUCTOR_POOL_WAIT_MARGIN_S="10")

    def copy_secrets(self, host: Host) -> None:
        """What the operator does by hand (README, "Two nodes with deploy/"):
        `scp -p A:run/deploy/cluster.secret run/deploy/`,
        `scp -rp A:run/deploy/etcd-access run/deploy/` and
        `scp -rp A:run/deploy/worker-tls run/deploy/`."""
        src, dst = self.state_dir(self.a), self.state_dir(host)
        dst.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / "cluster.secret", dst / "cluster.secret")
        for name in ("etcd-access", "worker-tls"):
            if not (dst / name).exists():
                shutil.copytree(src / name, dst / name)

    def start_worker(self, w: Worker) -> None:
        if w.host != self.a:
            self.copy_secrets(w.host)
        own = tempfile.mkdtemp(prefix="kvcluster-ipc-")
        self.socket_dirs.append(own)
        # the reference engine's dtype: logprobs compared exactly (the default, "auto", is
        # bfloat16 here, whose logprobs move with the batch: up to 0.027 apart)
        self.script(w.host, f"{w.role}.sh", KVCLUSTER_INSTANCE_ID=w.instance_id,
                    VLLM_RPC_BASE_PATH=own, KVCLUSTER_DIST_DIR=own,
                    KVCLUSTER_KV_CACHE_BYTES=str(self.kv_cache_bytes),
                    KVCLUSTER_WORKER_ENGINE_CPUS=w.cpus, VLLM_CPU_OMP_THREADS_BIND=w.cpus,
                    OMP_NUM_THREADS=str(ENGINE_THREADS), KVCLUSTER_WORKER_DTYPE=DTYPE)

    def remove_socket_dirs(self) -> None:
        """Once every worker is gone."""
        for d in self.socket_dirs:
            shutil.rmtree(d, ignore_errors=True)
        self.socket_dirs.clear()

    def ctl(self, *args: str, timeout: float = 60.0) -> str:
        """`conductorctl` on node A, as the README's deploy section runs it."""
        env = self.env(self.a, KVCLUSTER_ADMIN_ADDR=ADMIN, KVCLUSTER_ADMIN_TOKEN_FILE=str(
            self.state_dir(self.a) / "admin.token"))
        return net.run(sys.executable, "-m", "conductorctl", *args, ns=self.a.ns, env=env,
                       timeout=timeout, cwd=str(ROOT)).stdout

    def instances(self) -> dict[str, dict]:
        """instance id -> its row in `conductorctl --json instances` ({} while unreachable)."""
        try:
            reply = json.loads(self.ctl("--json", "instances", timeout=15))
        except (RuntimeError, ValueError, subprocess.TimeoutExpired):
            return {}
        return {i["instance_id"]: i for i in reply.get("instances", [])}

    def wait_serving(self, ids: list[str], timeout: float) -> dict[str, dict]:
        """Until every one of `ids` is listed as serving; the last listing."""
        deadline = time.monotonic() + timeout
        while True:
            rows = self.instances()
            if all(rows.get(i, {}).get("state") == "serving" for i in ids):
                return rows
            if time.monotonic() > deadline:
                raise TimeoutError(f"not all of {ids} serving after {timeout:.0f}s: "
                                   f"{ {k: v.get('state') for k, v in rows.items()} }")
            time.sleep(1.0)

    def segments(self, keys: list[str]) -> dict[str, str | None]:
        """key -> the pool segment (host:port) holding it, asked of the master from host A."""
        p = net.run(sys.executable, "-m", "tests.hosts.segments", f"{self.a.addr}:50051",
                    f"http://{self.a.addr}:8080/metadata", self.a.addr, ns=self.a.ns,
                    env=self.env(self.a), input=json.dumps(keys), cwd=str(ROOT), timeout=120)
        return json.loads(p.stdout.strip().splitlines()[-1])

    def kv_namespace(self, w: Worker) -> str:
        """The pool namespace `w`'s engine logged at start (`store.namespace`)."""
        text = (self.state_dir(w.host) / f"{w.instance_id}.log").read_text(errors="replace")
        return re.findall(r"engine_started .*namespace=(\S+)", text)[-1]

    def log_tail(self, name: str, host: Host, lines: int = 30) -> str:
        path = self.state_dir(host) / f"{name}.log"
        if not path.exists():
            return f"(no {path})"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
