"""The embedded single-machine cluster: etcd, the Mooncake master, prefill and decode workers,
and the conductor, each a child process in its own process group, all on loopback.

`python -m embedded` (what `make run` calls, `embedded.command`) starts it, prints the
endpoints and a `curl` line, keeps it running and stops every child on Ctrl-C. Tests use the
same class, so the tests and the user run one code path.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import psutil
import structlog

from cluster import loopback, plane_tls, shape
from cluster.engine_spec import EngineSpec
from cluster.etcd_server import EtcdServer
from cluster.instance import cpu_list, format_cpu_list
from cluster.plane_tls import PlaneTLS
from cluster.ports import ports_from
from cluster.process import ManagedProcess, children_on
from cluster.secret import ClusterSecret, bind
from cluster.shape import Shape
from cluster.workers import WorkerSpec
from embedded.supervisor import RestartPolicy, Supervised
from protos import worker_pb2_grpc
from store.master import StoreClientService, StoreMaster

log = structlog.get_logger(__name__)

WORKER_RESTARTS = 5
"""Workers `make run` starts again after they failed (an engine that died), in all: a
cluster whose workers keep failing stops instead (the last failure's log tail says why)."""


@dataclass(frozen=True)
class ClusterSpec(EngineSpec):
    model: str
    prefill: int = 1
    decode: int = 1
    http_port: int = 8000
    """0 picks a free port."""
    etcd_port: int = 0
    store_rpc_port: int = 0
    store_metadata_port: int = 0
    run_dir: str = ""
    """Logs and data; a temporary directory when empty."""
    policy: str = "kv_centric"
    both: int = 0
    shape: Shape | None = None
    """The engines to start, their roles and cores; None: `prefill` + `decode` + `both`
    engines with this machine's cores shared out (`cluster.shape`)."""
    worker_env: tuple[tuple[str, str], ...] = ()
    """Environment of every worker, after its engine's placement."""
    pool_shm: bool = True
    """Workers exchange KV through one standalone `mooncake_client` on this machine (shared
    memory, memcpy) instead of each contributing a TCP segment: on one host the memcpy path
    is the faster one (`make bench-kv`), and Mooncake's TCP transfers between busy engine
    processes can stall for the pool's 5 s timeout under a burst (docs/design.md, "On one
    host, shared memory, not TCP")."""
    conductor_args: tuple[str, ...] = ()
    conductors: int = 1
    """Conductor replicas, all serving this cluster (the same etcd, workers, cluster secret
    and admin token): each on its own ports, `http_port` and the next free ones above it
    (`admin_port` likewise). Replica 0 alone starts worker processes for `ResizePool` (two
    would name theirs alike); the others' `resize` only drains, undrains and switches."""
    conductor_restarts: RestartPolicy = field(default_factory=RestartPolicy)
    """How a conductor that exits is started again (`embedded.supervisor`): by the loop of
    `python -m embedded`, or `EmbeddedCluster._check_alive(restart=True)`."""
    step_target_ms: float = field(init=False, default=0.0)
    """How long its engines' steps beside streams may take: a share of the TBT SLO the
    conductor will hold decodes to, read once as the conductor reads its settings (its flags
    over its environment over its defaults): a bad setting exits with the conductor's message
    when the spec is made, before anything starts. The engines start with it; the conductor
    keeps them at its SLO from then on (`conductor.step_targets`)."""
    admin_port: int = 0
    """The conductor's admin API on 127.0.0.1 (token in `<run_dir>/admin.token`); 0 picks a
    free port, -1 turns it off."""
    worker_tls: bool = False
    """The worker plane over mutual TLS (`cluster.plane_tls`; files made in
    `<run_dir>/worker-tls`). Off: plaintext, on loopback."""
    allow_wildcard_binds: bool = False
    """Start even where Mooncake's servers cannot be kept on loopback (`cluster.loopback`:
    no C compiler for its bind shim), their listeners then on every address. Off: such a
    start is refused (`LoopbackUnavailable`) before any process starts, and so is one that
    finds a listener of its processes beyond loopback once they are up."""

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 0 or self.both < 0:
            raise ValueError("worker counts must be non-negative")
        if self.conductors < 1:
            raise ValueError(f"conductors must be at least 1, got {self.conductors}")
        if not os.path.isdir(self.model):
            raise ValueError(f"model must be a local model directory: {self.model!r}")
        if self.shape is None:
            object.__setattr__(self, "shape", shape.choose(
                shape.machine_cores(), 0, self.prefill, self.decode, self.both))
        from conductor.config import parse_args

        # its etcd endpoint is only known at start: any valid one parses the rest alike
        config = parse_args(["--model", self.model, "--etcd", "127.0.0.1:1",
                             *self.conductor_args])
        object.__setattr__(self, "step_target_ms", shape.step_target_ms(config.tbt_slo_s))

    def engines(self) -> int:
        assert self.shape is not None
        return len(self.shape.engines)


@dataclass
class WorkerProcess:
    instance_id: str
    role: str
    port: int
    process: ManagedProcess
    engine: shape.Engine | None = None

    @property
    def address(self) -> str:
        """Where the worker listens: what its `READY` line says (`worker.main`: another
        process may have taken the port it was given), else that port."""
        with contextlib.suppress(OSError):
            for line in reversed(self.process.log_path.read_text(errors="replace").splitlines()):
                if line.startswith(f"READY {self.instance_id} "):
                    return line.split()[2]
        return f"127.0.0.1:{self.port}"


@dataclass
class EmbeddedCluster:
    spec: ClusterSpec
    run_dir: Path = field(init=False)
    etcd: EtcdServer | None = None
    master: StoreMaster | None = None
    store_client: StoreClientService | None = None
    workers: dict[str, WorkerProcess] = field(default_factory=dict)
    conductors: list[Supervised] = field(default_factory=list)
    """The conductor replicas, in the order of `http_ports`."""
    http_ports: list[int] = field(default_factory=list)
    admin_ports: list[int] = field(default_factory=list)
    """Empty with the admin API off."""
    admin_token: str = ""
    _counter: dict[str, int] = field(default_factory=dict)
    _restarts: int = 0
    _machine_cpus: str = field(init=False, default="")
    """Where engines without cores of their own compute, when the serving processes are
    kept to theirs (`WorkerSpec.machine_cpus`)."""

    def __post_init__(self) -> None:
        self.run_dir = Path(self.spec.run_dir or tempfile.mkdtemp(prefix="kvcluster-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self._serving_cpus():
            self._machine_cpus = format_cpu_list(os.sched_getaffinity(0))

    @property
    def conductor(self) -> ManagedProcess | None:
        """Replica 0's process now (another after a restart)."""
        child = self.conductors[0].child if self.conductors else None
        assert child is None or isinstance(child, ManagedProcess)
        return child

    @property
    def http_port(self) -> int:
        """Replica 0's (`url`); 0 before the start."""
        return self.http_ports[0] if self.http_ports else 0

    @property
    def admin_port(self) -> int:
        return self.admin_ports[0] if self.admin_ports else 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def urls(self) -> list[str]:
        """Every replica's endpoint, replica 0's (`url`) first."""
        return [f"http://127.0.0.1:{p}" for p in self.http_ports]

    def describe_shape(self) -> str:
        assert self.spec.shape is not None
        return self.spec.shape.describe()

    @property
    def admin_addr(self) -> str:
        return f"127.0.0.1:{self.admin_port}"

    @property
    def admin_addrs(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.admin_ports]

    @property
    def token_file(self) -> Path:
        return self.run_dir / "admin.token"

    @property
    def secret_file(self) -> Path:
        """The cluster secret of this run (`cluster.secret`), made at start."""
        return self.run_dir / "cluster.secret"

    @property
    def tls_dir(self) -> Path | None:
        """The worker plane's TLS files of this run (`cluster.plane_tls`), if it has TLS."""
        return self.run_dir / "worker-tls" if self.spec.worker_tls else None

    def worker_channel(self, address: str, tls: bool = True) -> grpc.Channel:
        """A blocking channel to the worker at `address`, as the conductor dials it (`tls`
        False: plaintext whatever the plane uses)."""
        tls_dir = self.tls_dir if tls else None
        return plane_tls.channel(address, PlaneTLS.load(str(tls_dir or ""), "client"))

    def worker_stub(self, address: str, channel: grpc.Channel | None = None
                    ) -> worker_pb2_grpc.WorkerStub:
        """A client of the worker at `address` (on `channel`, else a new one as the conductor
        dials it) whose calls carry that worker's token."""
        stub = worker_pb2_grpc.WorkerStub(channel or self.worker_channel(address))
        secret = ClusterSecret.load(str(self.secret_file))
        return bind(stub, secret.metadata(address)) if secret else stub

    def worker_spec(self) -> WorkerSpec:
        assert self.etcd is not None and self.master is not None, "start() first"
        s, sc = self.spec, self.store_client
        return WorkerSpec(model=s.model, etcd=self.etcd.endpoint,
                          pool_master=self.master.master_addr,
                          pool_metadata=self.master.metadata_url, run_dir=str(self.run_dir),
                          pool_store_client=sc.address if sc else "",
                          pool_store_client_segment=sc.segment_name if sc else "",
                          env=s.worker_env, **s.engine_kwargs(),
                          secret_file=str(self.secret_file), machine_cpus=self._machine_cpus,
                          serving_cpus=self.spec.shape.serving_cpus if self.spec.shape else "",
                          tls_dir=str(self.tls_dir or ""), step_target_ms=s.step_target_ms,
                          allow_wildcard_binds=s.allow_wildcard_binds)

    # -------------------------------------------------------------- start / stop

    def start(self, wait: bool = True, timeout: float = 240.0) -> EmbeddedCluster:
        """Start every process (`wait`: until it serves). `LoopbackUnavailable` where a
        server would listen beyond loopback and the spec does not allow that: before anything
        starts when the bind shim cannot be built, else once the cluster is ready (`wait`)
        if one of its processes listens there all the same; everything is stopped then."""
        loopback.library(self.spec.allow_wildcard_binds)
        try:
            with children_on(self._serving_cpus()):
                self._start_children()
            if wait:
                self.wait_ready(timeout)
                self._check_loopback()
        except BaseException:
            self.stop()
            raise
        return self

    def wide_listeners(self) -> list[tuple[str, int, int]]:
        """(address, port, pid) of what the cluster's processes (and theirs) listen on
        beyond loopback."""
        servers = (self.etcd, self.master, self.store_client)
        roots = [s.pid for s in servers if s is not None and s.pid is not None]
        roots += [p.pid for p in (*(w.process for w in self.workers.values()),
                                  *(c.child for c in self.conductors))
                  if isinstance(p, ManagedProcess) and p.proc is not None]
        pids = set(roots)
        for pid in roots:
            with contextlib.suppress(psutil.Error):
                pids |= {c.pid for c in psutil.Process(pid).children(recursive=True)}
        return loopback.wide_listeners(pids)

    def _check_loopback(self) -> None:
        wide = self.wide_listeners()
        if not wide:
            return
        if not self.spec.allow_wildcard_binds:
            raise loopback.LoopbackUnavailable(
                f"processes of the cluster listen beyond loopback: {wide} (address, port, "
                f"pid); start with {loopback.OPT_OUT} to accept that")
        log.warning("listening_beyond_loopback", listeners=wide)

    def _serving_cpus(self) -> frozenset[int] | None:
        """Where the serving processes run (`Shape.serving_cpus`), None: anywhere."""
        assert self.spec.shape is not None
        return cpu_list(self.spec.shape.serving_cpus) or None

    def _start_children(self) -> None:
        s = self.spec
        ClusterSecret.create(self.secret_file)
        if self.tls_dir is not None:
            plane_tls.make(self.tls_dir)
        self.etcd = EtcdServer(client_port=s.etcd_port or None,
                               data_dir=self.run_dir / "etcd",
                               log_path=self.run_dir / "etcd.log").start()
        self._fresh_control_state()
        self.master = StoreMaster(rpc_port=s.store_rpc_port or None,
                                  http_port=s.store_metadata_port or None,
                                  log_path=self.run_dir / "mooncake_master.log",
                                  allow_wildcard_binds=s.allow_wildcard_binds).start()
        if s.pool_shm:  # the pool's memory: every worker's share, in one process
            n = s.engines()
            self.store_client = StoreClientService(
                self.master, segment=f"{max(n, 1) * s.pool_segment_bytes >> 20}MB",
                log_path=self.run_dir / "mooncake_client.log",
                allow_wildcard_binds=s.allow_wildcard_binds).start()
        assert s.shape is not None
        log.info("cluster_shape", shape=s.shape.describe())
        for engine in s.shape.engines:
            self.start_worker(engine.role, engine)
        self.start_conductors()

    def _fresh_control_state(self) -> None:
        """A new cluster starts from its configuration: the control state an earlier one left
        in this run directory's etcd (drains, SLOs, fitted models) is deleted. A conductor that
        restarts within this cluster's life keeps it (`conductor.control_state`)."""
        from conductor.config import parse_args

        assert self.etcd is not None
        prefix = parse_args(["--model", self.spec.model, "--etcd", self.etcd.endpoint,
                             *self.spec.conductor_args]).control_prefix
        deleted = self.etcd.delete_prefix(prefix)
        if deleted:
            log.info("control_state_cleared", prefix=prefix, records=deleted)

    def start_worker(self, role: str, engine: shape.Engine | None = None) -> WorkerProcess:
        """One worker; `engine`: its placement (cores, threads), else unbound."""
        n = self._counter.get(role, 0)
        self._counter[role] = n + 1
        instance_id = f"{role}-{n}"
        proc, port = self.worker_spec().start(role, instance_id, placement=engine)
        wp = WorkerProcess(instance_id, role, port, proc, engine)
        self.workers[instance_id] = wp
        log.info("worker_started", instance_id=instance_id, pid=proc.pid, port=port)
        return wp

    def stop_worker(self, instance_id: str, kill: bool = False) -> None:
        wp = self.workers.pop(instance_id)
        if kill:
            wp.process.kill()
        else:
            wp.process.stop(timeout=20.0)

    def start_conductors(self) -> list[Supervised]:
        """Every replica (`ClusterSpec.conductors`), on ports chosen now (the first ones as
        the spec gives them), each `Supervised`."""
        s = self.spec
        if not self.http_ports:
            admin_given = {s.admin_port} if s.admin_port > 0 else set()
            self.http_ports = ports_from(s.http_port, s.conductors, taken=admin_given)
            if s.admin_port >= 0:
                self.admin_ports = ports_from(s.admin_port, s.conductors,
                                              taken=set(self.http_ports))
        argv, env = self._conductor_command()
        for i, port in enumerate(self.http_ports):
            name = "conductor" if i == 0 else f"conductor-{i}"
            command = [*argv, "--port", str(port)]
            if self.admin_ports:
                command += ["--admin-port", str(self.admin_ports[i])]
                if i == 0:  # ResizePool's processes: one replica starts them (`provision`)
                    command += ["--embedded-workers", str(self.run_dir / "workers.json")]
            command += list(s.conductor_args)
            replica = Supervised(name, self._starter(name, command, env), s.conductor_restarts)
            replica.start()
            self.conductors.append(replica)
        return self.conductors

    def _starter(self, name: str, argv: list[str], env: dict[str, str]
                 ) -> Callable[[], ManagedProcess]:
        """How a replica is started, each time: on the conductor's cores (`Shape`)."""
        assert self.spec.shape is not None
        cpus = cpu_list(self.spec.shape.conductor_home)

        def start() -> ManagedProcess:
            with children_on(cpus):
                return ManagedProcess(name, argv, self.run_dir / f"{name}.log", env=env).start()
        return start

    def _conductor_command(self) -> tuple[list[str], dict[str, str]]:
        """What every replica runs (without its ports) and its environment; the files they
        share (the admin token, the workers' spec) are made here."""
        assert self.etcd is not None
        s = self.spec
        argv = [sys.executable, "-m", "conductor", "--model", s.model,
                "--etcd", self.etcd.endpoint, "--policy", s.policy]
        if self.master is not None:
            argv += ["--pool-keys-url", self.master.metrics_url.rsplit("/", 1)[0]]
        env = dict(os.environ)
        env["KVCLUSTER_CONDUCTOR_SECRET_FILE"] = str(self.secret_file)
        if self.tls_dir is not None:
            env["KVCLUSTER_CONDUCTOR_TLS_DIR"] = str(self.tls_dir)
        if self.admin_ports:
            if not self.admin_token:
                self.admin_token = secrets.token_urlsafe(32)
                self.token_file.touch(mode=0o600)
                self.token_file.write_text(self.admin_token + "\n")
            self.worker_spec().save(self.run_dir / "workers.json")
            env["KVCLUSTER_CONDUCTOR_ADMIN_TOKEN_FILE"] = str(self.token_file)
        return argv, env

    def wait_ready(self, timeout: float = 240.0) -> None:
        """Until /health says every engine started is routable (or a child died): /health
        alone turns 200 with the first decode instance, since kv_centric serves on decode
        instances alone."""
        deadline = time.monotonic() + timeout
        need_workers = self.spec.engines() > 0
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                r = httpx.get(f"{self.url}/health", timeout=2.0)
                if not need_workers and r.status_code == 503:
                    return
                if r.status_code == 200 and r.json().get("routable", 0) >= len(self.workers):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"cluster not ready after {timeout:.0f}s; logs in {self.run_dir}")

    def _check_alive(self, restart: bool = False) -> None:
        """Raise if a child died; a worker that exited cleanly was retired (ResizePool).
        `restart`: a worker that failed (its engine died) is replaced by a new one in its
        place, up to `WORKER_RESTARTS` times in the cluster's life, and a conductor that
        exited is started again (`ClusterSpec.conductor_restarts`; `GaveUp` when it keeps
        dying); the workers are left as they are meanwhile."""
        for iid, w in list(self.workers.items()):
            if w.process.alive():
                continue
            w.process.stop()  # reaped: what its group left running, and its socket directory
            if w.process.returncode == 0:
                log.info("worker_retired", instance_id=iid)
                del self.workers[iid]
            elif restart and self._restarts < WORKER_RESTARTS:
                self._restarts += 1
                log.warning("worker_died", instance_id=iid, returncode=w.process.returncode,
                            restarts=self._restarts, log_tail=w.process.tail(10))
                del self.workers[iid]
                self.start_worker(w.role, w.engine)
        for replica in self.conductors:
            if restart:
                replica.poll()
            elif replica.child is not None and not replica.child.alive():
                raise RuntimeError(f"{replica.name} exited; last log lines:\n"
                                   f"{replica.child.tail()}")
        for p in (w.process for w in self.workers.values()):
            if not p.alive():
                raise RuntimeError(f"{p.name} exited; last log lines:\n{p.tail()}")

    def stop(self) -> None:
        """Stop everything, conductors first, store and etcd last. Safe to call twice."""
        conductors, self.conductors = self.conductors, []
        for replica in conductors:  # in parallel, as the workers
            if replica.child is not None and isinstance(replica.child, ManagedProcess):
                replica.child.signal_group(signal.SIGTERM)
        for replica in conductors:
            replica.stop(timeout=10.0)
        workers = list(self.workers.values())
        self.workers.clear()
        for wp in workers:  # in parallel: each drains and shuts its engine down
            wp.process.signal_group(signal.SIGTERM)
        for wp in workers:
            wp.process.stop(timeout=20.0)
        if self.store_client is not None:
            self.store_client.stop()
            self.store_client = None
        if self.master is not None:
            self.master.stop()
            self.master = None
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd = None

    def __enter__(self) -> EmbeddedCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
