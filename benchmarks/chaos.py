"""`make chaos`: kill parts of a running cluster under traffic and classify every answer.

An embedded cluster (2 prefill + 2 decode workers, real vLLM engines, a real Mooncake master
and etcd) serves a fixed, deterministic set of greedy completions (token-id prompts, some
sharing long prefixes, half streamed) while a fault schedule runs, one fault at a time:

  decode   kill -9 a decode worker with streams in flight on it, start a new one
  prefill  kill -9 a prefill worker (one with prefills queued, when there is one), start one
  store    kill -9 the Mooncake master, restart it on the same ports a few seconds later
  etcd     stop etcd, start it again after 2x the lease TTL
  stall_decode  SIGSTOP a decode worker with streams on it for 15 s (past the inter-token
           deadline: its streams move on), then SIGCONT
  stall_store   SIGSTOP the Mooncake master for 8 s (past the pool's timeout), then SIGCONT

Two requests in every five share their client request id (`request_id`): each must still get
its own, right answer.

Every answer is compared with a single-engine greedy reference (tests/reference_engine.py,
computed before the cluster starts and cached in the run dir) and classified as ok,
clean_error, wrong, hung or lost (docs/reliability.md). The last line printed is

  chaos total=<n> ok=<n> clean_errors=<n> hung=<n> lost=<n> wrong=<n> migrated=<n>
  fallbacks=<n> stalled=<n>

(one line; `stalled`: the conductor's `decode_stalled` log lines, streams it moved on after
their inter-token deadline.)
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import logging
import math
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import httpx

from embedded import ClusterSpec, EmbeddedCluster
from protos import admin_pb2, admin_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
REFERENCE_ENGINE = ROOT / "tests" / "reference_engine.py"

BLOCK_SIZE = 32
MAX_MODEL_LEN = 2048
DTYPE = "float32"
MAX_TOKENS = (16, 48)
"""Each request asks for a length in this range (ignore_eos: it gets exactly that many)."""
LOGPROB_TOL = 1e-3
"""A token's logprob further than this from the reference's counts as logprob drift: a
diagnostic of a wrong KV prefix (the tiny model's greedy tokens seldom flip when an early
block is wrong, its logprobs do), reported beside the classes, not one of them."""
CLASSES = ("ok", "clean_error", "wrong", "hung", "lost")
FAULTS = ("decode", "prefill", "store", "etcd", "stall_decode", "stall_store")
STALL_TIMEOUT_S = 10.0
"""The conductor's inter-token deadline (`--stall-timeout-s`), set explicitly: derived, it
would be 30x the requests' TBT SLO, which this run sets out of reach (`--slo-ms`)."""
STALL_DECODE_S = 15.0
"""How long a decode worker stands still (SIGSTOP): past the inter-token deadline, so its
streams move on."""
STALL_STORE_S = 8.0
"""How long the Mooncake master stands still: past the pool's op timeout (5 s)."""
DUPLICATE_EVERY = 5
"""Requests 5k and 5k+1 send the same client request id (`request_id`): ordinary (a retry, a
copied snippet), and each must get its own answer."""
MEMBERSHIP_PREFIX = "/kvcluster/instances/"


# ------------------------------------------------------------------ the request set


@dataclass(frozen=True)
class Req:
    index: int
    prompt: tuple[int, ...]
    max_tokens: int
    stream: bool
    group: str
    """prefix-<k> (shares a long prefix), unique, or repeat-<i> (an earlier request's prompt)."""


def build_requests(n: int, seed: int, vocab: int) -> list[Req]:
    """Deterministic for (n, seed, vocab): ~60% share one of four long prefixes (a unique
    tail each), ~30% unique prompts (some short enough to be prefilled on the decode
    instance), ~10% repeat an earlier prompt exactly. Half stream, alternating."""
    rng = random.Random(seed)
    lo, hi = 5, vocab - 5  # clear of the special tokens at the start of the vocabulary

    def ids(k: int) -> list[int]:
        return [rng.randrange(lo, hi) for _ in range(k)]

    prefixes = [ids(k) for k in (1536, 1024, 640, 320)]
    reqs: list[Req] = []
    for i in range(n):
        max_tokens = rng.randint(*MAX_TOKENS)
        r = rng.random()
        if r < 0.1 and reqs:
            src = reqs[rng.randrange(len(reqs))]
            prompt, group = src.prompt, f"repeat-{src.index}"
        elif r < 0.7:
            k = rng.randrange(len(prefixes))
            prompt, group = tuple(prefixes[k] + ids(rng.randint(8, 120))), f"prefix-{k}"
        else:
            length = rng.choice((rng.randint(8, 60), rng.randint(100, 1200)))
            prompt, group = tuple(ids(length)), "unique"
        assert len(prompt) + MAX_TOKENS[1] <= MAX_MODEL_LEN
        reqs.append(Req(i, prompt, max_tokens, stream=i % 2 == 1, group=group))
    return reqs


# ------------------------------------------------------------------ the reference


def reference(model: str, prompts: list[tuple[int, ...]], run_dir: Path) -> dict:
    """prompt -> {"token_ids", "logprobs"} (MAX_TOKENS[1] tokens; greedy, so a shorter
    request's output is a prefix), from one standalone engine. Cached in the run dir per
    prompt, under a hash of the model and engine settings: a rerun computes only new prompts."""
    job = {"model": model, "block_size": BLOCK_SIZE, "max_model_len": MAX_MODEL_LEN,
           "dtype": DTYPE, "max_tokens": MAX_TOKENS[1], "runner_up": True}
    key = hashlib.sha256(json.dumps(job, sort_keys=True).encode()).hexdigest()[:16]
    cache = run_dir / f"reference-{key}.json"

    def pkey(p: tuple[int, ...]) -> str:
        return hashlib.sha256(json.dumps(p).encode()).hexdigest()

    known: dict[str, dict] = json.loads(cache.read_text()) if cache.exists() else {}
    missing = [p for p in prompts if pkey(p) not in known]
    print(f"reference: {len(prompts) - len(missing)} of {len(prompts)} distinct prompts cached "
          f"in {cache}", flush=True)
    if missing:
        print(f"reference: {len(missing)} prompts on one standalone engine ...", flush=True)
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, str(REFERENCE_ENGINE)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(json.dumps({**job, "prompts": [list(p) for p in missing]}),
                                        timeout=3600)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if proc.returncode != 0:
            raise RuntimeError(f"reference engine failed ({proc.returncode}):\n{err[-4000:]}")
        line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
        outs = json.loads(line.removeprefix("RESULT "))
        assert len(outs) == len(missing)
        known.update({pkey(p): o for p, o in zip(missing, outs, strict=True)})
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps(known))
        tmp.replace(cache)
        print(f"reference: done in {time.monotonic() - t0:.0f}s", flush=True)
    return {p: known[pkey(p)] for p in prompts}


# ------------------------------------------------------------------ one request


@dataclass
class Result:
    index: int
    stream: bool
    group: str
    cls: str = ""
    status: int = 0
    """HTTP status (0: none)."""
    detail: str = ""
    """Why it is not ok: the error message, or what differs."""
    t_start: float = 0.0
    t_end: float = 0.0
    ttft: float | None = None
    tokens: int = 0
    logprob_drift: float = 0.0
    """Largest |logprob - reference| over the tokens that match the reference."""
    decode_instance: str = ""
    tie_at: int | None = None
    """ok by an exact tie: at this position the reference's best and runner-up tokens had
    equal logprobs (within TIE_EPS) and this output took the runner-up; greedy output past a
    tie is not defined by the model, only by float noise."""


def _error_message(body: object) -> str | None:
    """The message of an OpenAI error object, None if `body` is not one."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict) \
            and isinstance(body["error"].get("message"), str):
        return body["error"]["message"]
    return None


TIE_EPS = 1e-5
"""Logprobs this close are a tie (float32 noise between batch shapes is ~1e-6 here)."""


def _compare(res: Result, ids: list[int], lps: list[float | None], ref: dict,
             max_tokens: int) -> str | None:
    """What is wrong with a complete output (None: identical to the reference)."""
    want = ref["token_ids"][:max_tokens]
    res.tokens = len(ids)
    n = 0
    while n < min(len(ids), len(want)) and ids[n] == want[n]:
        n += 1
    drift = [abs(a - b) for a, b in zip(lps[:n], ref["logprobs"][:n], strict=False)
             if a is not None]
    res.logprob_drift = max(drift, default=0.0)
    if ids == want:
        return None
    if len(ids) == max_tokens and n < len(want) and "runner_up" in ref:
        alt, alt_lp = ref["runner_up"][n]
        if ids[n] == alt and abs(ref["logprobs"][n] - alt_lp) <= TIE_EPS:
            res.tie_at = n
            return None
    if len(ids) != max_tokens:
        return f"{len(ids)} tokens, asked {max_tokens} (first difference at {n})"
    return f"tokens differ from the reference from position {n}"


def run_one(client: httpx.Client, url: str, req: Req, ref: dict, deadline_s: float,
            t_base: float, slo_ms: float) -> Result:
    res = Result(req.index, req.stream, req.group)
    shared = req.index % DUPLICATE_EVERY < 2  # a pair sharing its client id
    client_id = f"chaos-dup-{req.index // DUPLICATE_EVERY}" if shared else f"chaos-{req.index}"
    body = {"prompt": list(req.prompt), "max_tokens": req.max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "logprobs": 1, "stream": req.stream,
            "request_id": client_id}
    if slo_ms > 0:  # admission by SLO off: a 429 from a slow shared CPU is not a fault's doing
        body["ttft_slo_ms"] = body["tbt_slo_ms"] = slo_ms
    t0 = time.monotonic()
    res.t_start = t0 - t_base
    timeout = httpx.Timeout(deadline_s, connect=10.0)
    try:
        if not req.stream:
            r = client.post(f"{url}/v1/completions", json=body, timeout=timeout)
            res.status = r.status_code
            try:
                payload = r.json()
            except ValueError:
                payload = None
            if r.status_code != 200:
                msg = _error_message(payload)
                res.cls = "clean_error" if msg is not None else "wrong"
                res.detail = msg if msg is not None else \
                    f"HTTP {r.status_code} without an OpenAI error body: {r.text[:200]!r}"
            else:
                try:
                    choice = payload["choices"][0]
                    ids = list(choice["token_ids"])
                    lps = list(choice["logprobs"]["token_logprobs"])
                    res.decode_instance = payload.get("kv_transfer", {}).get("decode_instance", "")
                except (TypeError, KeyError, IndexError) as e:
                    res.cls, res.detail = "wrong", f"200 with a malformed body ({e!r})"
                else:
                    why = _compare(res, ids, lps, ref, req.max_tokens)
                    res.cls, res.detail = ("ok", "") if why is None else ("wrong", why)
        else:
            _stream(client, url, body, req, ref, res, timeout, t0, deadline_s)
    except httpx.TimeoutException as e:
        res.cls, res.detail = "hung", f"no answer within {deadline_s:.0f}s ({type(e).__name__})"
    except httpx.HTTPError as e:
        if res.status == 200:  # the stream had started: it ended without [DONE]
            res.cls = "wrong"
            res.detail = f"stream broken without [DONE]: {type(e).__name__}: {e}"
        else:
            res.cls, res.detail = "lost", f"{type(e).__name__}: {e}"
    res.t_end = time.monotonic() - t_base
    return res


def _stream(client: httpx.Client, url: str, body: dict, req: Req, ref: dict, res: Result,
            timeout: httpx.Timeout, t0: float, deadline_s: float) -> None:
    ids: list[int] = []
    lps: list[float | None] = []
    errors: list[str] = []
    done = after_done = False
    bad_events: list[str] = []
    with client.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as r:
        res.status = r.status_code
        if r.status_code != 200:
            r.read()
            try:
                msg = _error_message(r.json())
            except ValueError:
                msg = None
            res.cls = "clean_error" if msg is not None else "wrong"
            res.detail = msg if msg is not None else \
                f"HTTP {r.status_code} without an OpenAI error body: {r.text[:200]!r}"
            return
        for line in r.iter_lines():
            if time.monotonic() - t0 > deadline_s:
                raise httpx.ReadTimeout("stream still running at the deadline")
            if not line:
                continue
            if done:
                after_done = True
                continue
            if line == "data: [DONE]":
                done = True
                continue
            if not line.startswith("data: "):
                bad_events.append(line[:80])
                continue
            try:
                event = json.loads(line[6:])
            except ValueError:
                bad_events.append(line[:80])
                continue
            msg = _error_message(event)
            if msg is not None:
                errors.append(msg)
                continue
            for choice in event.get("choices") or ():
                new = list(choice.get("token_ids") or ())
                if new and res.ttft is None:
                    res.ttft = time.monotonic() - t0
                ids += new
                lp = choice.get("logprobs") or {}
                got = list(lp.get("token_logprobs") or ())
                lps += got + [None] * (len(new) - len(got))
    if not done:
        res.cls, res.detail = "wrong", f"stream ended without [DONE] after {len(ids)} tokens"
        _compare(res, ids, lps, ref, req.max_tokens)
        return
    if after_done or bad_events:
        res.cls = "wrong"
        res.detail = "events after [DONE]" if after_done else f"malformed event {bad_events[0]!r}"
        return
    if errors:
        # A clean error only if what was streamed before it is the reference's beginning.
        want = ref["token_ids"][:len(ids)]
        _compare(res, ids, lps, {"token_ids": want, "logprobs": ref["logprobs"]}, len(ids))
        if ids != want:
            res.cls = "wrong"
            res.detail = f"{len(ids)} tokens before the error event differ from the " \
                         f"reference: {errors[0]}"
        else:
            res.cls, res.detail = "clean_error", f"(stream, {len(ids)} tokens) {errors[0]}"
        return
    why = _compare(res, ids, lps, ref, req.max_tokens)
    res.cls, res.detail = ("ok", "") if why is None else ("wrong", why)


# ------------------------------------------------------------------ the cluster side


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


# ------------------------------------------------------------------ metrics and reporting


def scrape(url: str) -> dict[str, float]:
    """The counters the report needs from the conductor's /metrics (0 when absent)."""
    out = {"stream_migrations": 0.0, "fallbacks_total": 0.0, "retries_total": 0.0}
    by_label: dict[str, dict[str, float]] = {"fallbacks": {}, "retries": {}, "requests": {}}
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError as e:
        print(f"warning: /metrics not scraped: {e}", file=sys.stderr)
        return {**out, "scraped": False}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)", line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "kvcluster_stream_migrations_total":
            out["stream_migrations"] += value
        elif name == "kvcluster_fallbacks_total":
            out["fallbacks_total"] += value
            by_label["fallbacks"][labels] = value
        elif name == "kvcluster_retries_total":
            out["retries_total"] += value
            by_label["retries"][labels] = value
        elif name == "kvcluster_requests_total":
            by_label["requests"][labels] = value
    return {**out, **{f"{k}_by_label": v for k, v in by_label.items()}, "scraped": True}


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def _group_key(cls: str, status: int, detail: str) -> str:
    generic = re.sub(r"\b(chaos|cmpl)-\d+\b", r"\1-N", detail)
    generic = re.sub(r"(prefill|decode)-(s?)\d+", r"\1-\2N", generic)
    generic = re.sub(r"\d+(\.\d+)?", "N", generic)
    return f"{cls} {status}: {generic[:240]}"


def summarize(results: list[Result], chaos: Chaos, metrics: dict, args: argparse.Namespace,
              elapsed: float, stalled: int = 0) -> dict:
    counts = Counter(r.cls for r in results)
    ok = [r for r in results if r.cls == "ok"]
    lat = [r.t_end - r.t_start for r in ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    groups: dict[str, dict] = {}
    for r in results:
        if r.cls == "ok":
            continue
        g = groups.setdefault(_group_key(r.cls, r.status, r.detail),
                              {"count": 0, "example": r.detail, "requests": []})
        g["count"] += 1
        if len(g["requests"]) < 20:
            g["requests"].append(r.index)
    per_fault = []
    for w in chaos.windows:
        # every request in flight at some point between the fault and its recovery (+5 s)
        hit = [r for r in results if r.t_start <= w["end"] + 5.0 and r.t_end >= w["start"]]
        per_fault.append({"fault": w["fault"], "start_s": round(w["start"], 2),
                          "recovered_s": round(w["end"], 2), "requests_overlapping": len(hit),
                          "classes": dict(Counter(r.cls for r in hit))})
    drift = [r.logprob_drift for r in ok]
    return {
        "command": "python -m benchmarks.chaos " + " ".join(sys.argv[1:]),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": {"requests": args.requests, "concurrency": args.concurrency,
                   "seed": args.seed, "deadline_s": args.deadline_s, "faults": args.faults,
                   "slo_ms": args.slo_ms, "lease_ttl_s": args.lease_ttl,
                   "health_interval_s": args.health_interval,
                   "workers": {"prefill": 2, "decode": 2}, "block_size": BLOCK_SIZE,
                   "max_model_len": MAX_MODEL_LEN, "dtype": DTYPE, "max_tokens": MAX_TOKENS},
        "elapsed_s": round(elapsed, 1),
        "total": len(results),
        "classes": {c: counts.get(c, 0) for c in CLASSES},
        "by_mode": {mode: dict(Counter(r.cls for r in results if r.stream == (mode == "stream")))
                    for mode in ("stream", "non_stream")},
        "latency_ok_s": {"p50": percentile(lat, 50), "p99": percentile(lat, 99)},
        "ttft_ok_stream_s": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
        "logprob_drift_ok": {"tolerance": LOGPROB_TOL,
                             "over_tolerance": sum(d > LOGPROB_TOL for d in drift),
                             "max": max(drift, default=0.0)},
        "ok_by_tie": [{"request": r.index, "position": r.tie_at} for r in results
                      if r.cls == "ok" and r.tie_at is not None],
        "migrated": int(metrics.get("stream_migrations", 0)),
        "stalled": stalled,
        "fallbacks_total": int(metrics.get("fallbacks_total", 0)),
        "retries_total": int(metrics.get("retries_total", 0)),
        "metrics": metrics,
        "timeline": chaos.timeline,
        "per_fault": per_fault,
        "errors": dict(sorted(groups.items(), key=lambda kv: -kv[1]["count"])),
        "requests": [asdict(r) for r in results],
    }


def print_summary(s: dict) -> None:
    print("\n== fault timeline ==")
    for e in s["timeline"]:
        print(f"  t={e['t']:7.1f}s  sent={e['sent']:4d}  {e['fault']:8s} {e['action']:15s} "
              f"{e['detail']}")
    print("\n== per fault (requests in flight from the fault to 5 s after its recovery) ==")
    for f in s["per_fault"]:
        classes = " ".join(f"{c}={n}" for c, n in sorted(f["classes"].items()))
        print(f"  {f['fault']:8s} {f['start_s']:7.1f}s -> {f['recovered_s']:7.1f}s  "
              f"{f['requests_overlapping']:4d} requests: {classes}")
    print("\n== classes ==")
    print(f"  {'class':12s} {'all':>6s} {'stream':>7s} {'non-str':>7s}")
    for c in CLASSES:
        print(f"  {c:12s} {s['classes'][c]:6d} {s['by_mode']['stream'].get(c, 0):7d} "
              f"{s['by_mode']['non_stream'].get(c, 0):7d}")
    lat, ttft = s["latency_ok_s"], s["ttft_ok_stream_s"]

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}s"
    print(f"\n  ok latency p50 {fmt(lat['p50'])} p99 {fmt(lat['p99'])}; "
          f"ok stream TTFT p50 {fmt(ttft['p50'])} p99 {fmt(ttft['p99'])}")
    d = s["logprob_drift_ok"]
    print(f"  ok answers with a logprob off the reference by > {d['tolerance']}: "
          f"{d['over_tolerance']} (max {d['max']:.2e})")
    print(f"  ok answers that took the other side of an exact tie (|logprob difference| <= "
          f"{TIE_EPS}): {len(s['ok_by_tie'])} {s['ok_by_tie']}")
    print(f"  conductor: stream migrations {s['migrated']}, fall-backs {s['fallbacks_total']}, "
          f"retries {s['retries_total']}; elapsed {s['elapsed_s']}s")
    if s["errors"]:
        print("\n== not ok, grouped ==")
        for key, g in list(s["errors"].items())[:15]:
            print(f"  {g['count']:4d}  {key}")


# ------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks.chaos", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default="run/chaos",
                   help="cluster logs and the cached reference (default: run/chaos)")
    p.add_argument("--json-out", default="docs/chaos.json")
    p.add_argument("--model", default=os.environ.get("KVCLUSTER_MODEL", ""),
                   help="local HF model directory (default: the built-in tiny model)")
    p.add_argument("--deadline-s", type=float, default=120.0,
                   help="a request without a complete answer by then is hung")
    p.add_argument("--faults", default=",".join(FAULTS),
                   help=f"comma-separated, run in this order (of {','.join(FAULTS)}; "
                        "empty: none, a baseline)")
    p.add_argument("--slo-ms", type=float, default=600_000.0,
                   help="per-request ttft_slo_ms and tbt_slo_ms (0: the conductor's defaults, "
                        "which reject with 429 when this machine is slow)")
    p.add_argument("--lease-ttl", type=float, default=3.0)
    p.add_argument("--health-interval", type=float, default=0.5)
    a = p.parse_args(argv)
    a.fault_list = [f for f in a.faults.split(",") if f]
    bad = set(a.fault_list) - set(FAULTS)
    if bad:
        p.error(f"unknown faults {sorted(bad)}; known: {FAULTS}")
    if a.requests < 1 or a.concurrency < 1:
        p.error("--requests and --concurrency must be positive")
    return a


def main(argv: list[str] | None = None) -> int:
    from cluster.logging import configure
    from conductor.tokenizer import Tokenizer
    from tinymodel.builder import ensure_model

    args = parse_args(argv)
    configure("chaos", level=os.environ.get("KVCLUSTER_LOG_LEVEL", "WARNING"))
    logging.getLogger("httpx").setLevel(logging.WARNING)
    model = args.model or str(ensure_model())
    run_dir = Path(args.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)

    vocab = Tokenizer(model).vocab_size
    reqs = build_requests(args.requests, args.seed, vocab)
    distinct = list(dict.fromkeys(r.prompt for r in reqs))
    refs = reference(model, distinct, run_dir)

    def _sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, _sigterm)

    n = len(reqs)
    faults = args.fault_list
    at = [int(n * (k + 1) / (len(faults) + 1.5)) for k in range(len(faults))]
    cluster_dir = run_dir / time.strftime("cluster-%Y%m%dT%H%M%S")
    spec = ClusterSpec(model=model, prefill=2, decode=2, http_port=0, run_dir=str(cluster_dir),
                       block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, dtype=DTYPE,
                       kv_cache_bytes=256 << 20, pool_segment_bytes=256 << 20,
                       lease_ttl=args.lease_ttl, admin_port=0,
                       conductor_args=("--health-interval-s", str(args.health_interval),
                                       "--stall-timeout-s", str(STALL_TIMEOUT_S)))
    cluster = EmbeddedCluster(spec)
    admin: Admin | None = None
    chaos: Chaos | None = None
    pool: ThreadPoolExecutor | None = None
    results: list[Result] = []
    metrics: dict = {}
    t_traffic = time.monotonic()
    try:
        print(f"starting the cluster: 2 prefill + 2 decode (logs in {cluster_dir}) ...",
              flush=True)
        t0 = time.monotonic()
        cluster.start(timeout=600)
        admin = Admin(cluster)
        if not wait_until(lambda: len(admin.serving()) == 4, 600, every=0.5):
            raise RuntimeError(f"not all 4 workers registered: {admin.serving()}")
        print(f"cluster ready in {time.monotonic() - t0:.0f}s at {cluster.url}; "
              f"{n} requests, concurrency {args.concurrency}, faults {faults or 'none'} "
              f"at requests {at}", flush=True)

        t_traffic = time.monotonic()
        chaos = Chaos(cluster, admin, faults, at, n, args.concurrency, args.lease_ttl, t_traffic)
        chaos.thread.start()
        # a connection per request: a pooled one the server closed while idle would show as
        # a reset that no fault caused
        client = httpx.Client(limits=httpx.Limits(max_connections=args.concurrency + 4,
                                                  max_keepalive_connections=0))
        slots = threading.Semaphore(args.concurrency)
        lock = threading.Lock()
        tally: Counter[str] = Counter()
        every = max(1, n // 20)

        def task(req: Req) -> Result:
            try:
                res = run_one(client, cluster.url, req, refs[req.prompt], args.deadline_s,
                              t_traffic, args.slo_ms)
            finally:
                slots.release()
            with lock:
                results.append(res)
                tally[res.cls] += 1
                chaos.done_one()
                if len(results) % every == 0 or len(results) == n:
                    print(f"[t={time.monotonic() - t_traffic:7.1f}s] {len(results)}/{n} done: "
                          + " ".join(f"{c}={tally[c]}" for c in CLASSES), flush=True)
            return res

        pool = ThreadPoolExecutor(args.concurrency, thread_name_prefix="client")
        futures = []
        for req in reqs:
            chaos.before_send(req.index)
            slots.acquire()
            futures.append(pool.submit(task, req))
            chaos.sent_one()
        for f in futures:
            f.result()
        for ev in chaos.recovered:  # every fault fired and recovered (the thread stays)
            ev.wait()
        metrics = scrape(cluster.url)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the cluster ...", flush=True)
        if chaos is not None:
            chaos.stop.set()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        raise
    finally:
        if chaos is not None:
            chaos.stop.set()
        if admin is not None:
            admin.close()
        cluster.stop()
        if chaos is not None:
            chaos.release.set()
            chaos.thread.join(timeout=120)
            cluster.stop()  # again: a worker the fault thread started meanwhile
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    assert chaos is not None
    elapsed = time.monotonic() - t_traffic
    results.sort(key=lambda r: r.index)
    log = Path(cluster_dir, "conductor.log")
    stalled = log.read_text(errors="replace").count("decode_stalled") if log.exists() else 0
    summary = summarize(results, chaos, metrics, args, elapsed, stalled)
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print_summary(summary)
    print(f"\nJSON: {out}")
    c = summary["classes"]
    fallbacks = summary["fallbacks_total"] + summary["retries_total"]
    print(f"chaos total={summary['total']} ok={c['ok']} clean_errors={c['clean_error']} "
          f"hung={c['hung']} lost={c['lost']} wrong={c['wrong']} "
          f"migrated={summary['migrated']} fallbacks={fallbacks} stalled={stalled}", flush=True)
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:
        raise SystemExit(130) from None
