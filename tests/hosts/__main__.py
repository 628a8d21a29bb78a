"""`make test-hosts`: the deploy scripts run across three hosts made on this machine (network
namespaces joined by veth pairs and a bridge, `tests.hosts.net`), then faults between them.

  host A  etcd, the Mooncake master, the conductor   (deploy/etcd.sh, store_master.sh, conductor.sh)
  host B  a prefill and a decode worker              (deploy/prefill.sh, decode.sh)
  host C  a decode worker                            (deploy/decode.sh)

Requests come from the root namespace through the bridge. Each step prints its timing; the
last line is
  hosts n=<hosts> served=<n> cross_host_loads=<blocks> partition_ok=<true|false> leftovers=<n>
Exit 0 when every step passed and nothing was left behind; it skips (exit 0, saying why)
where the machine cannot make namespaces. Everything it made is removed at the end, also
when a step fails or it is interrupted (`--keep` leaves the cluster up to look at)."""

from __future__ import annotations

import argparse
import contextlib
import random
import shutil
import sys
import threading
import time
import traceback
from pathlib import Path

from cluster.signals import stop_on_signals
from tests.hosts import net
from tests.hosts.checks import Checks
from tests.hosts.cluster import ROOT, Cluster, Worker


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.hosts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", default=str(ROOT / "run" / "hosts"),
                   help="the hosts' state and logs, and the reference cache (kept)")
    p.add_argument("--flap-requests", type=int, default=24,
                   help="requests sent while host B's link flaps")
    p.add_argument("--kv-cache-mib", type=int, default=256, help="each engine's KV cache")
    p.add_argument("--keep", action="store_true",
                   help="leave the hosts and the cluster up at the end (clean up later with "
                        "`python -m tests.hosts --teardown`)")
    p.add_argument("--teardown", action="store_true",
                   help="only remove what an earlier run left (namespaces, links, processes)")
    return p.parse_args(argv)


class Steps:
    """Prints each step with the time since the start and its own duration."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.failed: str | None = None

    def run(self, name: str, fn, *args):
        t = time.monotonic()
        print(f"[{t - self.t0:6.1f}s] {name} ...", flush=True)
        try:
            out = fn(*args)
        except Exception as e:
            self.failed = f"{name}: {e}"
            print(f"[{time.monotonic() - self.t0:6.1f}s] {name}: FAILED after "
                  f"{time.monotonic() - t:.1f}s: {e}", flush=True)
            raise
        print(f"[{time.monotonic() - self.t0:6.1f}s] {name}: ok ({time.monotonic() - t:.1f}s)"
              + (f": {out}" if isinstance(out, str) and out else ""), flush=True)
        return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.teardown:
        left = net.teardown()
        print(f"leftovers={len(left)}" + "".join(f"\n  {x}" for x in left))
        return 1 if left else 0
    why = net.cannot_make_hosts()
    if why:
        print(f"test-hosts skipped: {why}")
        return 0
    left = net.teardown()
    if left:
        print(f"an earlier run's leftovers could not be removed: {left}", file=sys.stderr)
        return 1
    stop_on_signals()
    run_dir = Path(args.run_dir).resolve()
    steps = Steps()
    checks: Checks | None = None
    n_hosts = 3
    try:
        hosts = steps.run("hosts: 3 namespaces on a bridge", net.build, ["A", "B", "C"])
        a, b, c = hosts
        print("  " + ", ".join(f"{h.name}={h.addr}" for h in hosts) + f", root={net.GATEWAY}")
        model = steps.run("model", _model)
        workers = [Worker("prefill-b", "prefill", b, "0"), Worker("decode-b", "decode", b, "0"),
                   Worker("decode-c", "decode", c, "1")]
        for h in hosts:  # a fresh disk per host: no secret, token or etcd data of a past run
            shutil.rmtree(run_dir / f"host-{h.name.lower()}", ignore_errors=True)
        cluster = Cluster(a, workers, model, run_dir, args.kv_cache_mib << 20)
        checks = Checks(cluster, run_dir, random.Random(7))
        ref = threading.Thread(target=checks.prepare_reference, args=(args.flap_requests,),
                               daemon=True)
        ref.start()
        steps.run("host A: etcd, store master, conductor", cluster.start_node_a)
        for w in workers:
            steps.run(f"host {w.host.name}: {w.role} worker {w.instance_id}",
                      cluster.start_worker, w)
        steps.run("workers registered, verified and serving", checks.wait_all, 420.0)
        steps.run("reference outputs (one standalone engine)", _join, ref, checks)
        steps.run("listeners: each where its script says", checks.listeners)
        steps.run("strangers refused: worker calls in plaintext or without the token, etcd "
                  "without TLS", checks.strangers)
        steps.run("conductorctl on A lists and resizes across hosts", checks.ctl)
        steps.run("completion and stream across hosts (B prefills, C decodes)", checks.serve)
        steps.run("host C's link down mid-stream", checks.partition_c)
        steps.run("host C's link back up: rejoins and serves", checks.rejoin_c)
        steps.run("host B's link flapping under load", checks.flap_b)
        steps.run("etcd on A stopped and restarted", checks.etcd_restart)
    except KeyboardInterrupt as e:
        steps.failed = steps.failed or f"interrupted ({e})"
    except Exception:
        if steps.failed is None:
            steps.failed = "unexpected error"
        traceback.print_exc()
        if checks is not None:
            checks.print_logs()
    finally:
        if not args.keep:
            if checks is not None:
                t = time.monotonic()
                checks.stop_all()
                print(f"[{time.monotonic() - steps.t0:6.1f}s] deploy/stop.sh on every host "
                      f"({time.monotonic() - t:.1f}s)", flush=True)
            left = net.teardown() + _kill_children()
            if checks is not None:
                checks.cluster.remove_socket_dirs()
            for x in left:
                print(f"  left behind: {x}")
        else:
            left = []
            print("--keep: the hosts stay up; `python -m tests.hosts --teardown` removes them")
    served = checks.served if checks else 0
    loads = checks.cross_host_loads if checks else 0
    partition_ok = bool(checks and checks.partition_ok and steps.failed is None)
    if steps.failed:
        print(f"FAILED: {steps.failed}")
    print(f"hosts n={n_hosts} served={served} cross_host_loads={loads} "
          f"partition_ok={str(partition_ok).lower()} leftovers={len(left)}", flush=True)
    return 0 if steps.failed is None and not left else 1


def _kill_children() -> list[str]:
    """Our own children still running (the reference engine, in its own session, when the
    run stops early): killed; the ones that survive that are leftovers."""
    import psutil

    kids = psutil.Process().children(recursive=True)
    for p in kids:
        with contextlib.suppress(psutil.Error):
            p.kill()
    _, alive = psutil.wait_procs(kids, timeout=10)
    return [f"process {p.pid} (ours)" for p in alive]


def _model() -> str:
    from tinymodel.builder import ensure_model
    return str(ensure_model())


def _join(thread: threading.Thread, checks: Checks) -> str:
    thread.join(timeout=900)
    if thread.is_alive():
        raise TimeoutError("the reference engine did not finish in 15 minutes")
    if checks.reference_error:
        raise RuntimeError(checks.reference_error)
    return f"{len(checks.refs)} prompts"


if __name__ == "__main__":
    sys.exit(main())

