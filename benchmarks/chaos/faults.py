"""The cluster side: the admin API, etcd's membership, and the fault schedule (`Chaos`)."""

from __future__ import annotations

import base64
import os
import signal
import threading
import time

import grpc
import httpx
import psutil

from benchmarks.chaos.config import (
    MEMBERSHIP_PREFIX,
    STALL_DECODE_S,
    STALL_ENGINE_AFTER_S,
    STALL_STORE_S,
)
from embedded import EmbeddedCluster
from protos import admin_pb2, admin_pb2_grpc


class Admin:
    def __init__(self, cluster: EmbeddedCluster) -> None:
        self._channel = grpc.insecure_channel(cluster.admin_addr)
        self._stub = admin_pb2_grpc.AdminStub(self._channel)
        self._md = (("authorization", f"Bearer {cluster.token_file.read_text().strip()}"),)

    def instances(self) -> dict[str, admin_pb2.Instance]:
        try:
            reply = self._stub.ListInstances(admin_pb2.ListInstancesRequest(), metadata=self._md,
                                             timeout=5.0)
        except grpc.RpcError:
            return {}
        return {i.instance_id: i for i in reply.instances}

    def serving(self, role: str | None = None) -> list[str]:
        return [i.instance_id for i in self.instances().values()
                if i.state == "serving" and (role is None or i.role == role)]

    def close(self) -> None:
        self._channel.close()


def etcd_members(client_url: str, prefix: str = MEMBERSHIP_PREFIX) -> set[str]:
    """The instance ids registered under `prefix` (etcd's JSON gateway; empty if down)."""
    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    try:
        r = httpx.post(f"{client_url}/v3/kv/range", timeout=2.0,
                       json={"key": b64(prefix), "range_end": b64(end),
                             "keys_only": True})
        kvs = r.json().get("kvs", [])
    except (httpx.HTTPError, ValueError):
        return set()
    return {base64.b64decode(kv["key"]).decode().removeprefix(prefix) for kv in kvs}


def engine_core(worker_pid: int) -> int:
    """The pid of the vLLM engine core process under a worker."""
    for p in psutil.Process(worker_pid).children(recursive=True):
        try:
            if p.name().startswith("VLLM::EngineCore") or "EngineCore" in " ".join(p.cmdline()):
                return p.pid
        except psutil.Error:
            continue
    raise RuntimeError(f"no engine core under worker pid {worker_pid}")


def wait_until(predicate, timeout: float, every: float = 0.25,
               stop: threading.Event | None = None) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if stop is not None and stop.is_set():
            return False
        if predicate():
            return True
        time.sleep(every)
    return predicate()


class Chaos:
    """The fault schedule: fault k fires once request `at[k]` + concurrency has been sent (so
    requests are in flight), and requests past `at[k+1]` wait until fault k has recovered:
    one fault at a time, each under traffic."""

    def __init__(self, cluster: EmbeddedCluster, admin: Admin, faults: list[str], at: list[int],
                 total: int, concurrency: int, lease_ttl: float, t_base: float) -> None:
        self.cluster = cluster
        self.total = total
        self.admin = admin
        self.faults = faults
        self.at = at
        self.concurrency = concurrency
        self.lease_ttl = lease_ttl
        self.t_base = t_base
        self.sent = 0
        self.done = 0
        self.cv = threading.Condition()
        self.recovered = [threading.Event() for _ in faults]
        self.stop = threading.Event()
        """Set: abandon the faults (Ctrl-C, or the end)."""
        self.release = threading.Event()
        """Set once the cluster is stopped: only then may the fault thread exit. The workers
        it started run under `setpriv --pdeathsig KILL`, and Linux sends that signal when
        the parent *thread* exits: a thread that ended after its last fault would kill the
        replacement workers under traffic."""
        self.timeline: list[dict] = []
        self.windows: list[dict] = []
        self.stalled_engines: list[str] = []
        """Instances whose engine core `stall_engine` stopped."""
        self.thread = threading.Thread(target=self._run, name="chaos", daemon=True)

    # the traffic side
    def before_send(self, i: int) -> None:
        """Block request i while an earlier fault has not recovered (see the class doc)."""
        for k, at in enumerate(self.at):
            if k > 0 and i == at:
                t0 = time.monotonic()
                while not self.recovered[k - 1].wait(0.5):
                    if self.stop.is_set():
                        return
                waited = time.monotonic() - t0
                if waited > 0.5:
                    self.event(self.faults[k - 1], "traffic_paused",
                               f"request {i} waited {waited:.1f}s for the recovery")

    def sent_one(self) -> None:
        with self.cv:
            self.sent += 1
            self.cv.notify_all()

    def done_one(self) -> None:
        with self.cv:
            self.done += 1

    def event(self, fault: str, action: str, detail: str = "") -> dict:
        e = {"t": round(time.monotonic() - self.t_base, 2), "sent": self.sent,
             "done": self.done, "fault": fault, "action": action, "detail": detail}
        self.timeline.append(e)
        print(f"[chaos t={e['t']:7.1f}s sent={e['sent']:4d} done={e['done']:4d}] {fault}: "
              f"{action}{' - ' + detail if detail else ''}", flush=True)
        return e

    # the fault side
    def _run(self) -> None:
        try:
            for k, fault in enumerate(self.faults):
                # some requests in flight, without waiting past the next gate (or the end)
                trigger = min(self.at[k] + self.concurrency,
                              self.at[k + 1] if k + 1 < len(self.at) else self.total)
                with self.cv:
                    while self.sent < trigger and not self.stop.is_set():
                        self.cv.wait(0.5)
                if self.stop.is_set():
                    return
                window = {"fault": fault, "start": time.monotonic() - self.t_base}
                try:
                    getattr(self, f"_{fault}")()
                except Exception as e:  # record it, go on with the next fault
                    self.event(fault, "fault_failed", f"{type(e).__name__}: {e}")
                window["end"] = time.monotonic() - self.t_base
                self.windows.append(window)
                self.recovered[k].set()
        finally:
            for ev in self.recovered:
                ev.set()
            self.release.wait()

    def _pick(self, role: str, busy: str) -> tuple[str, str]:
        """The instance of `role` with the most `busy` requests (waiting up to 10 s for one
        with some), and how loaded it was."""
        best: admin_pb2.Instance | None = None

        def look() -> bool:
            nonlocal best
            cands = [i for i in self.admin.instances().values()
                     if i.role == role and i.instance_id in self.cluster.workers]
            if cands:
                best = max(cands, key=lambda i: (getattr(i, busy), i.in_flight))
            return best is not None and getattr(best, busy) > 0
        wait_until(look, 10.0, every=0.05, stop=self.stop)
        if best is None:
            best_id = next(i for i, w in self.cluster.workers.items() if w.role == role)
            return best_id, "not listed by the conductor"
        return best.instance_id, (f"in_flight={best.in_flight} running={best.running} "
                                  f"queued_prompt_tokens={best.queued_prompt_tokens}")

    def _kill_worker(self, role: str, busy: str) -> None:
        iid, load = self._pick(role, busy)
        pid = self.cluster.workers[iid].process.pid
        self.cluster.stop_worker(iid, kill=True)
        self.event(role, "kill -9", f"{iid} pid {pid} ({load})")
        t0 = time.monotonic()
        gone = wait_until(lambda: iid not in self.admin.serving(), 30, every=0.05,
                          stop=self.stop)
        self.event(role, "out_of_routing" if gone else "still_routed",
                   f"{iid} after {time.monotonic() - t0:.1f}s")
        wp = self.cluster.start_worker(role)
        self.event(role, "restart", f"started {wp.instance_id} pid {wp.process.pid}")
        t1 = time.monotonic()
        ok = wait_until(lambda: wp.instance_id in self.admin.serving(), 600, every=0.5,
                        stop=self.stop)
        self.event(role, "recovered" if ok else "not_recovered",
                   f"{wp.instance_id} serving after {time.monotonic() - t1:.1f}s")

    def _decode(self) -> None:
        self._kill_worker("decode", "running")

    def _prefill(self) -> None:
        self._kill_worker("prefill", "queued_prompt_tokens")

    def _store(self) -> None:
        master = self.cluster.master
        assert master is not None
        pid = master.pid
        master.kill()
        self.event("store", "kill -9", f"mooncake_master pid {pid}")
        self.stop.wait(3.0)
        if self.stop.is_set():
            return
        master.restart()  # the same ports: the workers' clients remount by themselves
        self.event("store", "restart", f"mooncake_master pid {master.pid} on "
                   f"{master.master_addr}, empty pool")
        self.stop.wait(2.0)
        self.event("store", "recovered", f"{len(self.admin.serving())} instances serving")

    def _stall_decode(self) -> None:
        iid, load = self._pick("decode", "running")
        process = self.cluster.workers[iid].process
        process.signal_group(signal.SIGSTOP)
        self.event("stall_decode", "SIGSTOP", f"{iid} pid {process.pid} for "
                   f"{STALL_DECODE_S:.0f}s ({load})")
        self.stop.wait(STALL_DECODE_S)
        process.signal_group(signal.SIGCONT)
        self.event("stall_decode", "SIGCONT", iid)
        t0 = time.monotonic()
        ok = wait_until(lambda: iid in self.admin.serving(), 120, every=0.5, stop=self.stop)
        self.event("stall_decode", "recovered" if ok else "not_recovered",
                   f"{iid} serving after {time.monotonic() - t0:.1f}s")

    def _stall_engine(self) -> None:
        """The engine core alone stopped: the worker's front end answers its health checks
        and calls, its engine holds work and does not step (`worker.progress`)."""
        iid, load = self._pick("decode", "in_flight")
        core = engine_core(self.cluster.workers[iid].process.pid)
        os.kill(core, signal.SIGSTOP)
        self.stalled_engines.append(iid)
        self.event("stall_engine", "SIGSTOP", f"{iid}'s engine core pid {core} ({load})")
        t0 = time.monotonic()
        left = wait_until(lambda: iid not in self.admin.serving(), 60, every=0.1,
                          stop=self.stop)
        self.event("stall_engine", "out_of_routing" if left else "still_serving",
                   f"{iid} after {time.monotonic() - t0:.1f}s")

        def stalled() -> bool:  # its own watchdog's verdict, not a breaker's
            inst = self.admin.instances().get(iid)
            return inst is not None and inst.why == "stalled"
        found = wait_until(stalled, 60, every=0.1, stop=self.stop)
        self.event("stall_engine", "shown_stalled" if found else "not_shown_stalled",
                   f"{iid} after {time.monotonic() - t0:.1f}s")
        self.stop.wait(STALL_ENGINE_AFTER_S)
        os.kill(core, signal.SIGCONT)
        self.event("stall_engine", "SIGCONT", iid)
        t1 = time.monotonic()
        ok = wait_until(lambda: iid in self.admin.serving(), 120, every=0.5, stop=self.stop)
        self.event("stall_engine", "recovered" if ok else "not_recovered",
                   f"{iid} serving after {time.monotonic() - t1:.1f}s")

    def _stall_store(self) -> None:
        master = self.cluster.master
        assert master is not None and master.pid is not None
        pid = master.pid
        os.kill(pid, signal.SIGSTOP)
        self.event("stall_store", "SIGSTOP", f"mooncake_master pid {pid} for "
                   f"{STALL_STORE_S:.0f}s")
        self.stop.wait(STALL_STORE_S)
        os.kill(pid, signal.SIGCONT)
        self.stop.wait(2.0)
        self.event("stall_store", "recovered", f"SIGCONT; {len(self.admin.serving())} "
                   "instances serving")

    def _etcd(self) -> None:
        etcd = self.cluster.etcd
        assert etcd is not None
        etcd.stop()
        self.event("etcd", "stop", f"etcd {etcd.endpoint}, for {2 * self.lease_ttl:.0f}s")
        self.stop.wait(2 * self.lease_ttl)
        if self.stop.is_set():
            return
        etcd.start()
        self.event("etcd", "restart", f"etcd {etcd.endpoint}")
        t0 = time.monotonic()
        want = set(self.cluster.workers)

        def back() -> bool:  # registered in etcd again, and routed by the conductor
            return want <= etcd_members(etcd.client_url) and want <= set(self.admin.serving())
        ok = wait_until(back, 120, every=0.5, stop=self.stop)
        self.event("etcd", "recovered" if ok else "not_recovered",
                   f"{len(etcd_members(etcd.client_url) & want)}/{len(want)} workers "
                   f"registered in etcd, {len(set(self.admin.serving()) & want)}/{len(want)} "
                   f"serving, {time.monotonic() - t0:.1f}s after the restart")


