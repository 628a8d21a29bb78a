"""A pool client whose network goes away with a call in flight, on real hosts (network
namespaces, as root; skipped, saying why, elsewhere): the call's reply is lost, and TCP
retransmits it on its backoff, seconds after the network is back. The pool must answer again
well before that: the call, stuck, holds it unavailable until a fresh call to the master
answers (`store.pool.calls.InFlight`). That is how `make test-hosts` once failed: host C's
decode worker, back and serving, recomputed a prompt it should have loaded."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.hosts import net
from tests.hosts.cluster import ROOT

pytestmark = pytest.mark.slow

OUTAGE_S = 7.0
"""From the lost reply to the network's return: a retransmission backoff of 0.2 s doubling
puts the reply's next copy at 12.6 s, 5.6 s after the return."""
ANSWER_WITHIN_S = 2.0


def _json_lines(p: subprocess.Popen, stderr: Path):
    """The client's next JSON line (Mooncake logs its own lines to stdout too)."""
    while True:
        line = p.stdout.readline()
        if not line:
            tail = stderr.read_text(errors="replace")[-2000:]
            raise AssertionError(f"the client ended without answering; its stderr:\n{tail}")
        if line.startswith("{"):
            return json.loads(line)


@pytest.fixture
def hosts():
    why = net.cannot_make_hosts()
    if why:
        pytest.skip(why)
    net.teardown()
    a, c = net.build(["A", "C"])
    try:
        yield a, c
    finally:
        left = net.teardown()
        assert not left, left


def _spawn(host: net.Host, stderr: Path, *args: str) -> subprocess.Popen:
    with stderr.open("w") as err:
        return subprocess.Popen(["ip", "netns", "exec", host.ns, sys.executable, *args],
                                cwd=str(ROOT), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=err, text=True)


def test_the_pool_answers_again_soon_after_a_lost_reply_s_network_comes_back(hosts, tmp_path):
    a, c = hosts
    master = _spawn(a, tmp_path / "master.err", "-m", "store.master", "--host", a.addr,
                    "--rpc-port", "50051", "--http-port", "8080",
                    "--log", str(tmp_path / "master.log"))
    client = None
    try:
        assert master.stdout.readline().startswith("KVCLUSTER_POOL_MASTER_ADDR=")
        client_err = tmp_path / "client.err"
        client = _spawn(c, client_err, "-m", "tests.partition_client", a.addr, c.addr)
        assert _json_lines(client, client_err) == {"ready": True}
        # Replies to C are dropped (C's side of the bridge sends nothing: a queue of 0), so
        # the lookup reaches the master and its reply is lost; then C's link goes down too.
        net.run("tc", "qdisc", "add", "dev", c.link, "root", "pfifo", "limit", "0")
        t_lost = time.monotonic()
        client.stdin.write("call\n")
        client.stdin.flush()
        call = _json_lines(client, client_err)
        assert call["found"] == [False] and not call["healthy"] and call["stuck"] == 1, call
        net.set_link(c, up=False)
        time.sleep(max(0.0, t_lost + OUTAGE_S - time.monotonic()))  # the outage under test
        net.set_link(c, up=True)
        net.run("tc", "qdisc", "del", "dev", c.link, "root")
        client.stdin.write("healed\n")
        client.stdin.flush()
        healed = _json_lines(client, client_err)
    finally:
        for p in (client, master):
            if p is not None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
    answered, stuck = healed["answered_s"], healed["stuck_returned_s"]
    assert answered is not None and answered < ANSWER_WITHIN_S, healed
    # The case under test happened: the stuck call outlived the outage by more than that.
    assert stuck is None or stuck > answered + 1.0, healed
