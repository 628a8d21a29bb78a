"""`make bench-sched`: how long one routing decision takes at cluster scale.

A snapshot of 64 prefill and 64 decode instances under load, a KV index of 1,000,000 blocks
(conversations that share system prompts and earlier turns, cached in the pool and on a few
instances each), and 8K-token prompts with realistic prefix overlap. Timed per decision: the
index lookup, the scoring and the choice (`index.match` + the policy), as the conductor does
per request; hashing the prompt is timed apart (it happens once, in `prepare`), so is
freezing the snapshot. Then kv_centric and round_robin again at 256x256 and 1,024x1,024
instances over indexes of `--blocks` and twice that, and the decision's share of the
conductor's work per request. `--profile` prints where kv_centric's decision spends its time
instead. The last line is the summary.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import logging
import pstats
import random
import sys
import time
import tracemalloc
from collections.abc import Callable

import structlog

from conductor.scheduler import (
    POLICIES,
    POOL,
    ClusterSnapshot,
    KVIndex,
    LoadState,
    RouteRequest,
    SchedulerParams,
)
from store.block_hash import block_hashes

BLOCK = 32
PROMPT_TOKENS = 8192
PROMPT_BLOCKS = PROMPT_TOKENS // BLOCK
NOW = 10_000.0
SCALES = ((256, 1), (1024, 2))
"""(instances per role, index blocks in units of --blocks) of the scaled runs"""
CONDUCTOR_US = 1470.0
"""The conductor's own work per 1-token request on the chosen shape, accept + parse + route
+ answer (0.21 + 0.55 + 0.29 + 0.42 ms, medians of the probes' timelines: docs/design.md,
"The conductor's own cost", the Xeon of 2026-11-28): wall-clock on another machine, so the
share derived from it is an estimate; the share of the router's work is measured here."""


def build_loads(rng: random.Random, n_prefill: int, n_decode: int) -> list[LoadState]:
    """Loads as the conductor would count them: queues of predicted prefill work, decode
    batches with predicted finish times, KV in use."""
    loads = []
    for i in range(n_prefill):
        s = LoadState(f"prefill-{i}", "prefill", BLOCK)
        for r in range(rng.choice((0, 0, 1, 2, 4))):
            s.add_prefill(f"r{r}", PROMPT_TOKENS, rng.randrange(1, PROMPT_TOKENS),
                          rng.uniform(0.05, 0.8), NOW - rng.uniform(0, 0.2))
        loads.append(s)
    for i in range(n_decode):
        s = LoadState(f"decode-{i}", "decode", BLOCK, kv_capacity_tokens=400_000)
        for r in range(rng.randrange(0, 48)):
            s.add_decode(f"r{r}", rng.randrange(500, PROMPT_TOKENS), NOW + rng.uniform(0, 30))
        loads.append(s)
    return loads


def build_snapshot(rng: random.Random, n_prefill: int, n_decode: int) -> ClusterSnapshot:
    return ClusterSnapshot(tuple(s.view(rng.randrange(0, 20_000))
                                 for s in build_loads(rng, n_prefill, n_decode)),
                           NOW, SchedulerParams())


def time_requests(index: KVIndex, loads: list[LoadState], requests: list[RouteRequest],
                  policy: Callable, in_flight: int = 256) -> list[float]:
    """Per request, all the scheduling work the conductor's router does at steady state, in
    this thread's CPU time: patch the snapshot with the loads changed since the previous
    request, look the blocks up, decide, and count the choice into the load model (the
    request `in_flight` decisions earlier finishes then, so the load stays level)."""
    by_id = {s.instance_id: s for s in loads}
    dirty: set[str] = set()
    for s in loads:
        s.on_change = dirty.add
    snap = ClusterSnapshot(tuple(s.view() for s in loads), NOW, SchedulerParams())
    window: list[tuple[str, str, str]] = []
    out = []
    clock = time.thread_time_ns
    for n, req in enumerate(requests):
        now = NOW + n * 1e-4
        t0 = clock()
        snap = snap.replacing([by_id[i].view() for i in dirty], now)
        dirty.clear()
        d = policy(snap, RouteRequest(req.num_prompt_tokens, req.block_hashes,
                                      index.match(req.block_hashes), req.max_tokens, req.seq))
        if hasattr(d, "prefill_id"):
            rid = f"b{n}"
            by_id[d.prefill_id].add_prefill(rid, req.num_prompt_tokens, d.uncached_tokens,
                                            d.prefill_s, now)
            by_id[d.decode_id].add_decode(rid, req.num_prompt_tokens, now + 5.0)
            window.append((rid, d.prefill_id, d.decode_id))
        if len(window) > in_flight:
            rid, p, dd = window.pop(0)
            by_id[p].end_prefill(rid, now)
            by_id[dd].end_decode(rid)
        out.append((clock() - t0) / 1000.0)
    for s in loads:
        s.on_change = None
    return out


def build_index(rng: random.Random, target_blocks: int, names: list[str], prefill: list[str],
                decode: list[str]) -> tuple[KVIndex, list[list[int]], list[list[int]]]:
    """System prompts (16-64 blocks) shared by many conversations (up to 256 blocks); each
    conversation is in the pool and cached on one or two prefill and maybe one decode
    instance, each holding a prefix of it (their caches evict from the tail)."""
    index = KVIndex(max_blocks=target_blocks + target_blocks // 50)  # about half in each generation
    for n in names:
        index.add_location(n)
    systems = [[rng.getrandbits(64) for _ in range(rng.randrange(16, 65))] for _ in range(64)]
    for s in systems:
        index.store(POOL, s)
    conversations: list[list[int]] = []
    while len(index) < target_blocks:
        sysp = rng.choice(systems)
        conv = sysp + [rng.getrandbits(64) for _ in range(rng.randrange(32, PROMPT_BLOCKS)
                                                           - len(sysp) + 1)]
        conv = conv[:min(PROMPT_BLOCKS, len(sysp) + target_blocks - len(index))]
        index.store(POOL, conv)
        for name in rng.sample(prefill, rng.choice((1, 1, 2))):
            index.store(name, conv[:rng.randrange(len(sysp), len(conv) + 1)])
        if rng.random() < 0.5:
            index.store(rng.choice(decode), conv[:rng.randrange(len(sysp), len(conv) + 1)])
        conversations.append(conv)
    return index, systems, conversations


def make_requests(rng: random.Random, n: int, systems: list[list[int]],
                  conversations: list[list[int]]) -> list[RouteRequest]:
    """8K-token prompts: 50% continue a conversation, 25% share only a system prompt, 25% new.
    Hashes are random 64-bit ints chained like real ones (same statistics, cheaper)."""
    out = []
    for seq in range(n):
        r = rng.random()
        if r < 0.5:
            conv = rng.choice(conversations)
            head = conv[:rng.randrange(len(conv) // 2, len(conv) + 1)]
        elif r < 0.75:
            head = list(rng.choice(systems))
        else:
            head = []
        hashes = head + [rng.getrandbits(64) for _ in range(PROMPT_BLOCKS - len(head))]
        out.append(RouteRequest(PROMPT_TOKENS, tuple(hashes), max_tokens=rng.choice((64, 256, 512)),
                                seq=seq))
    return out


def time_decisions(index: KVIndex, snap: ClusterSnapshot, requests: list[RouteRequest],
                   policy: Callable) -> tuple[list[float], list[float], dict[str, int]]:
    """Per-decision microseconds of lookup + scoring + choice, in this thread's CPU time and
    in wall-clock time, and what was decided."""
    outcomes = {"route": 0, "local": 0, "reject": 0, "hit_blocks": 0}
    cpu, wall = [], []
    cpu_clock, wall_clock = time.thread_time_ns, time.perf_counter_ns
    for req in requests:
        w0, c0 = wall_clock(), cpu_clock()
        full = RouteRequest(req.num_prompt_tokens, req.block_hashes, index.match(req.block_hashes),
                            req.max_tokens, req.seq)
        decision = policy(snap, full)
        c1, w1 = cpu_clock(), wall_clock()
        cpu.append((c1 - c0) / 1000.0)
        wall.append((w1 - w0) / 1000.0)
        if hasattr(decision, "prefill_id"):
            outcomes["route"] += 1
            outcomes["local"] += not decision.disaggregated
            outcomes["hit_blocks"] += decision.cached_blocks
        else:
            outcomes["reject"] += 1
    return cpu, wall, outcomes


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(int(q * len(s)), len(s) - 1)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", type=int, default=64)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--decisions", type=int, default=20_000)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scaled-decisions", type=int, default=5_000)
    ap.add_argument("--no-scales", action="store_true", help="64x64 only")
    ap.add_argument("--profile", action="store_true",
                    help="profile kv_centric's decisions at 64x64 and stop")
    a = ap.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    rng = random.Random(a.seed)

    loads = build_loads(rng, a.prefill, a.decode)
    snap = ClusterSnapshot(tuple(s.view(rng.randrange(0, 20_000)) for s in loads), NOW,
                           SchedulerParams())
    prefill = [i.instance_id for i in snap.prefill()]
    decode = [i.instance_id for i in snap.decode()]
    t0 = time.perf_counter()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index, systems, conversations = build_index(rng, a.blocks, prefill + decode, prefill, decode)
    # what the build allocated, less the benchmark's own lists of the conversations' hashes
    # (the hash ints themselves are the index's keys and stay counted)
    lists = sum(sys.getsizeof(c) for c in conversations + systems) + sys.getsizeof(conversations)
    index_bytes = tracemalloc.get_traced_memory()[0] - base - lists
    tracemalloc.stop()
    print(f"index: {len(index)} blocks, {len(conversations)} conversations, "
          f"{index_bytes / len(index):.1f} bytes/block, built in {time.perf_counter() - t0:.1f}s")
    requests = make_requests(rng, a.decisions, systems, conversations)

    gc.collect()
    gc.freeze()  # the index is long-lived: keep the collector from rescanning it
    if a.profile:
        profile_decisions(index, snap, requests)
        return
    print(f"per decision (index lookup + scoring + choice): {a.decisions} decisions x "
          f"{a.passes} passes per policy, CPU time of this thread; p50/p99 of the median pass "
          "(by p99), every pass's p99 beside it, and the wall-clock p99 of that pass.")
    results: dict[str, list[float]] = {}
    for name in ["kv_centric", *sorted(n for n in POLICIES if n != "kv_centric")]:
        passes = []
        for _ in range(a.passes):
            time_decisions(index, snap, requests[:500], POLICIES[name])  # warm up
            passes.append(time_decisions(index, snap, requests, POLICIES[name]))
        cpu, wall, out = sorted(passes, key=lambda r: pct(r[0], 0.99))[len(passes) // 2]
        results[name] = cpu
        routed = max(out["route"], 1)
        every = " ".join(f"{pct(c, 0.99):.0f}" for c, _, _ in passes)
        print(f"{name:>13}: p50={pct(cpu, 0.5):5.1f}us p99={pct(cpu, 0.99):5.1f}us "
              f"(raw p99 per pass: {every}; wall p99 {pct(wall, 0.99):.0f}) | "
              f"routed={out['route']} local_prefill={out['local']} rejected={out['reject']} "
              f"mean_hit={out['hit_blocks'] * BLOCK / routed:.0f} tokens")

    t = time.perf_counter_ns()
    for _ in range(200):
        ClusterSnapshot(tuple(s.view() for s in loads), NOW, SchedulerParams())
    snap_us = (time.perf_counter_ns() - t) / 200 / 1000
    steady = sorted((time_requests(index, loads, requests, POLICIES["kv_centric"])
                     for _ in range(a.passes)), key=lambda r: pct(r, 0.99))[a.passes // 2]
    print(f"per request, kv_centric, all the router's work at steady state (snapshot patch + "
          f"lookup + decision + load counting, 256 in flight): p50={pct(steady, 0.5):.1f}us "
          f"p99={pct(steady, 0.99):.1f}us")
    tokens = [rng.randrange(32000) for _ in range(PROMPT_TOKENS)]
    t = time.perf_counter_ns()
    for _ in range(50):
        block_hashes(tokens, BLOCK)
    hash_us = (time.perf_counter_ns() - t) / 50 / 1000
    print(f"for scale: freezing a {a.prefill}x{a.decode} snapshot whole {snap_us:.0f}us, "
          f"hashing an {PROMPT_TOKENS}-token prompt {hash_us:.0f}us")

    kv = results["kv_centric"]
    print(f"kv_centric's decision at p50 over the router's work per request (same run): "
          f"{pct(kv, 0.5) / pct(steady, 0.5):.0%}; over the conductor's per-request work, "
          f"{CONDUCTOR_US:.0f}us from docs/design.md (another machine, wall-clock): "
          f"{pct(kv, 0.5) / CONDUCTOR_US:.1%}")
    scaled = {} if a.no_scales else {
        n: time_scaled(rng, n, a.blocks * k, a.scaled_decisions) for n, k in SCALES}
    extra = " ".join(f"p99_us_{n}={pct(kv_n, 0.99):.1f}" for n, (kv_n, _) in scaled.items())
    print(f"sched p50_us={pct(kv, 0.5):.1f} p99_us={pct(kv, 0.99):.1f} {extra} "
          f"instances={a.prefill}x{a.decode} blocks={len(index)} "
          f"index_mb={index_bytes / 1e6:.1f} rr_p99_us={pct(results['round_robin'], 0.99):.1f}")


def time_scaled(rng: random.Random, n: int, blocks: int, decisions: int
                ) -> tuple[list[float], list[float]]:
    """kv_centric's and round_robin's decisions at n x n instances over `blocks` blocks: the
    CPU times of the median of three passes (by p99) each, printed."""
    snap = ClusterSnapshot(tuple(s.view(rng.randrange(0, 20_000))
                                 for s in build_loads(rng, n, n)), NOW, SchedulerParams())
    prefill = [i.instance_id for i in snap.prefill()]
    decode = [i.instance_id for i in snap.decode()]
    t0 = time.perf_counter()
    gc.unfreeze()
    index, systems, conversations = build_index(rng, blocks, prefill + decode, prefill, decode)
    requests = make_requests(rng, decisions, systems, conversations)
    gc.collect()
    gc.freeze()
    built = time.perf_counter() - t0
    out = []
    for name in ("kv_centric", "round_robin"):
        passes = []
        for _ in range(3):
            time_decisions(index, snap, requests[:200], POLICIES[name])  # warm up
            passes.append(time_decisions(index, snap, requests, POLICIES[name]))
        cpu, wall, got = sorted(passes, key=lambda r: pct(r[0], 0.99))[1]
        out.append(cpu)
        print(f"{n}x{n}, {len(index)} blocks (built in {built:.0f}s), {name:>11}: "
              f"p50={pct(cpu, 0.5):6.1f}us p99={pct(cpu, 0.99):6.1f}us "
              f"(wall p99 {pct(wall, 0.99):.0f}) | routed={got['route']} "
              f"local_prefill={got['local']} rejected={got['reject']}")
    return out[0], out[1]


def profile_decisions(index: KVIndex, snap: ClusterSnapshot, requests: list[RouteRequest]
                      ) -> None:
    """cProfile over kv_centric's decisions (the lookups done beforehand, apart)."""
    full = [RouteRequest(r.num_prompt_tokens, r.block_hashes, index.match(r.block_hashes),
                         r.max_tokens, r.seq) for r in requests]
    policy = POLICIES["kv_centric"]
    prof = cProfile.Profile()
    prof.enable()
    for req in full:
        policy(snap, req)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
