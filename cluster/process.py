"""Child processes of the launcher and the tests, each in its own process group.

A child is started as the leader of a process group of its own so that `stop()`/`kill()`
reach its own children too (vLLM's engine core), and through `setpriv --pdeathsig KILL` so
that it dies with its parent. In the parent's session, not a new one: Linux's scheduler
shares the CPU out between sessions first (autogroups), so with every child a session of its
own, two engines computing on two cores starve the conductor, the worker front ends, the
store and the load generator for seconds at a time, even at niceness 10 (docs/design.md,
"Children are process groups in the launcher's session").
No `preexec_fn`: that forces a real fork(), and gRPC's fork handlers then abort children
of a process with RPCs in flight.

Linux sends the parent-death signal when the *thread* that forked exits, not the process: a
child started from a short-lived thread would be killed with it. So every child is started
from one long-lived spawner thread, whichever thread asks.

Children started inside `children_on(cpus)` run on those cores (the spawner thread takes
them for the fork: a child inherits its forking thread's affinity, and its children theirs).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from pathlib import Path

IPC_ENV = "VLLM_RPC_BASE_PATH"
"""Where vLLM makes its processes' ZeroMQ socket files: the temporary directory, and it never
removes them (6,277 in /tmp after a few days of tests here). A child that runs vLLM gets a
directory of its own there as its `scratch` (`vllm_scratch`); short, since a socket's path
may not exceed 107 bytes."""

DIST_ENV = "KVCLUSTER_DIST_DIR"
"""Where the engine core of one of our vLLM engines makes torch.distributed's rendezvous file
(`worker.vllm_plugin`); vLLM's own place, the temporary directory, keeps every one of an engine
killed or stopped by a signal (one per engine of every cluster stopped that way). Set beside
`IPC_ENV`, to the same directory."""

_SETPRIV = shutil.which("setpriv")
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spawner")
"""Lives as long as the process: the parent-death signal follows the forking thread."""


_CHILD_CPUS: ContextVar[frozenset[int] | None] = ContextVar("child_cpus", default=None)


@contextlib.contextmanager
def children_on(cpus: frozenset[int] | None) -> Iterator[None]:
    """Children started inside this block (by this thread or task) run on `cpus` (None or
    empty: wherever the parent runs)."""
    token = _CHILD_CPUS.set(cpus or None)
    try:
        yield
    finally:
        _CHILD_CPUS.reset(token)


def _popen(cpus: frozenset[int] | None, argv: list[str], **kw) -> subprocess.Popen[bytes]:
    """In the spawner thread: fork with its affinity set to `cpus`, then restore it."""
    if not cpus:
        return subprocess.Popen(argv, **kw)
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        return subprocess.Popen(argv, **kw)
    finally:
        os.sched_setaffinity(0, old)


def _die_with_parent(argv: list[str]) -> list[str]:
    """argv wrapped so that the child gets SIGKILL when its parent dies (where setpriv exists)."""
    return [_SETPRIV, "--pdeathsig", "KILL", "--", *argv] if _SETPRIV else argv


def vllm_scratch(env: MutableMapping[str, str]) -> str | None:
    """A new socket directory for a child that runs vLLM, set as its `IPC_ENV` and `DIST_ENV`
    in `env`: the child's `scratch`, removed once it is reaped, however it ended. None (and
    `env` as it was) where `env` names a directory already."""
    if env.get(IPC_ENV):
        return None
    env[IPC_ENV] = env[DIST_ENV] = tempfile.mkdtemp(prefix="kvcluster-ipc-")
    return env[IPC_ENV]


@contextlib.contextmanager
def vllm_scratch_here() -> Iterator[str]:
    """`vllm_scratch` for engines this process starts itself (vLLM's `LLM`): the directory is
    this process's `IPC_ENV` and `DIST_ENV` inside the block and removed after it, so shut the
    engines down inside it."""
    env: dict[str, str] = {}
    path = vllm_scratch(env)
    assert path is not None
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield path
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(path, ignore_errors=True)


class ManagedProcess:
    """One supervised child: started in its own process group, logged to a file, stopped as a
    group."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        scratch: str | None = None,
    ) -> None:
        """`scratch`: a directory of the child's own (its sockets, say), removed once the
        child is reaped by `stop` or `kill`."""
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = dict(os.environ if env is None else env)
        self.cwd = cwd
        self.scratch = scratch
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab", buffering=0)
        try:
            self.proc = _SPAWNER.submit(
                _popen,
                _CHILD_CPUS.get(),
                _die_with_parent(self.argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.cwd,
                process_group=0,
            ).result()
        finally:
            log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} was never started"
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """The exit status once it exited (negative: killed by that signal), else None."""
        return None if self.proc is None else self.proc.poll()

    def signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL the whole group (the child and everything it started) and reap it."""
        self.signal_group(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()
        self._reaped()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the group, wait up to `timeout`, then SIGKILL what is left."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.signal_group(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while self.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        # Grandchildren may outlive a child that exited on SIGTERM: sweep the group.
        self.signal_group(signal.SIGKILL)
        self.proc.wait()
        self._reaped()

    def _reaped(self) -> None:
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


class ManagedServer:
    """What every server this code starts and supervises shares (etcd, the Mooncake master, the
    store client): one `ManagedProcess`, started by `_launch` and waited on until the
    subclass's `ready()`; then alive / stop / kill / tail / pid."""

    log_path: Path
    _proc: ManagedProcess | None = None

    def ready(self, deadline: float) -> bool:
        """The server answers (subclasses); `deadline` (monotonic) bounds any waiting inside."""
        raise NotImplementedError

    def _launch(self, name: str, argv: Sequence[str], timeout: float,
                env: Mapping[str, str] | None = None) -> int | None:
        """Start `argv` and wait until `ready()`: None then, or the exit status if it exits
        first; RuntimeError (with the log's tail) when not ready within `timeout` seconds."""
        proc = self._proc = ManagedProcess(name, argv, self.log_path, env=env).start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not proc.alive():
                assert proc.proc is not None
                return proc.proc.wait()
            if self.ready(deadline):
                return None
            time.sleep(0.05)
        proc.kill()
        raise RuntimeError(f"{name} not ready within {timeout}s; log {self.log_path}:\n"
                           f"{proc.tail()}")

    def alive(self) -> bool:
        return self._proc is not None and self._proc.alive()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.proc else None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (then SIGKILL after `timeout`)."""
        if self._proc is not None:
            self._proc.stop(timeout)

    def kill(self) -> None:
        """SIGKILL, as in a crash."""
        if self._proc is not None:
            self._proc.kill()

    def tail(self, lines: int = 40) -> str:
        return self._proc.tail(lines) if self._proc is not None else ""
