"""Nothing of the embedded cluster listens beyond loopback (`cluster.loopback`): Mooncake's
servers, which bind every address whatever they are told, included. Where the bind shim cannot
be built (simulated: `$CC` a missing binary, an empty cache) the cluster refuses to start,
unless the operator allows wildcard binds."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys

import psutil
import pytest

from cluster import loopback
from cluster.ports import wait_for_port
from cluster.shape import Shape
from embedded import ClusterSpec, EmbeddedCluster
from store.master import StoreClientService, StoreMaster


def _children() -> set[int]:
    """Every process this test process started, and theirs."""
    return {p.pid for p in psutil.Process().children(recursive=True)}


def listeners(pids: set[int]) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every listening TCP socket the processes `pids` hold."""
    out = []
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.Error:  # gone meanwhile
            continue
        out += [(c.laddr.ip, c.laddr.port, pid) for c in conns
                if c.status == psutil.CONN_LISTEN]
    return out


def _wide(found: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    def loop(a: str) -> bool:
        ip = ipaddress.ip_address(a)
        mapped = getattr(ip, "ipv4_mapped", None)
        return (mapped or ip).is_loopback

    return [f for f in found if not loop(f[0])]


def test_the_shim_is_for_loopback_hosts_only_and_keeps_other_preloads():
    assert loopback.library() is not None, "cc is on every machine of this kind"
    env = loopback.env("127.0.0.1", {"LD_PRELOAD": "/x.so"})
    assert env["LD_PRELOAD"].split() == [str(loopback.library()), "/x.so"]
    assert env["MC_TCP_BIND_ADDRESS"] == "127.0.0.1"  # what its transfer engine advertises
    assert loopback.env("198.18.77.10", {}) == {}


def test_wildcard_binds_become_loopback_and_others_pass_through():
    probe = """
import socket
s4 = socket.socket(); s4.bind(("0.0.0.0", 0))
s6 = socket.socket(socket.AF_INET6)
s6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0); s6.bind(("::", 0)); s6.listen()
socket.create_connection(("127.0.0.1", s6.getsockname()[1])).close()  # IPv4 clients still
o6 = socket.socket(socket.AF_INET6)
o6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1); o6.bind(("::", 0))
e = socket.socket(); e.bind(("127.0.0.2", 0))
print(s4.getsockname()[0], s6.getsockname()[0], o6.getsockname()[0], e.getsockname()[0])
"""
    for host, expect in (("127.0.0.1", "127.0.0.1 ::ffff:127.0.0.1 ::1 127.0.0.2"),
                         ("10.1.2.3", "0.0.0.0 :: :: 127.0.0.2")):
        out = subprocess.run([sys.executable, "-c", probe], env=loopback.env(host),
                             capture_output=True, text=True, check=True, timeout=60).stdout
        assert out.split() == expect.split(), host


def test_the_store_master_and_client_listen_on_loopback_only(tmp_path):
    with StoreMaster(log_path=tmp_path / "master.log") as master:
        client = StoreClientService(master, segment="64MB", log_path=tmp_path / "client.log")
        try:
            client.start()
            found = listeners(_children())
            ports = {p for _, p, _ in found}
            assert {master.http_port, master.rpc_port, client.port} <= ports
            assert not _wide(found), found
        finally:
            client.stop()


def test_without_the_shim_the_master_listens_on_every_address():
    """What the shim is for, and that `listeners` sees a wide socket when there is one."""
    master = StoreMaster()  # not started: its ports and command line
    p = subprocess.Popen(master.argv(), env=loopback.env("10.1.2.3"),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_for_port("127.0.0.1", master.http_port, 30)
        assert _wide(listeners({p.pid})), listeners({p.pid})
    finally:
        p.kill()
        p.wait()


def test_nothing_of_the_embedded_cluster_listens_beyond_loopback(cluster):
    """The whole cluster: etcd, the master, the workers and their engines' transfer engines
    (TCP pool, as across hosts), the conductor."""
    found = listeners(_children())
    assert len({pid for _, _, pid in found}) >= 5, found  # etcd, master, 2 engines, conductor
    assert not _wide(found), found


@pytest.fixture
def no_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path):
    """A machine where the shim cannot be built: an empty shim cache, `$CC` a missing binary
    (in this process and the children it starts, which build nothing)."""
    monkeypatch.setattr(loopback, "cache_dir", lambda: tmp_path / "cache")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    loopback.shim.cache_clear()
    yield
    loopback.shim.cache_clear()  # the real one again for the tests after


def test_without_a_compiler_a_loopback_host_is_refused_unless_wildcards_are_allowed(
        no_compiler, monkeypatch):
    with pytest.raises(loopback.LoopbackUnavailable) as e:
        loopback.env("127.0.0.1", {})
    why = str(e.value)
    assert "no-such-cc" in why and "--allow-wildcard-binds" in why and "every address" in why
    allowed = loopback.env("127.0.0.1", {}, allow_wildcard=True)
    assert "LD_PRELOAD" not in allowed and allowed["MC_TCP_BIND_ADDRESS"] == "127.0.0.1"
    assert loopback.env("198.18.77.10", {}) == {}  # not meant for loopback: nothing to keep
    # no compiler at all (no $CC, none on PATH): refused the same way
    monkeypatch.delenv("CC")
    monkeypatch.setattr(loopback.shutil, "which", lambda name: None)
    loopback.shim.cache_clear()
    with pytest.raises(loopback.LoopbackUnavailable, match="no C compiler"):
        loopback.env("127.0.0.1", {})


def _no_engines(model_dir: str, run_dir, allow: bool) -> ClusterSpec:
    return ClusterSpec(model=model_dir, shape=Shape((), "no engines"), http_port=0,
                       admin_port=-1, run_dir=str(run_dir), allow_wildcard_binds=allow)


def test_without_the_shim_the_embedded_cluster_starts_nothing(no_compiler, model_dir,
                                                              tmp_path):
    before = _children()  # another test's cluster, still up for the tests after
    cluster = EmbeddedCluster(_no_engines(model_dir, tmp_path / "run", allow=False))
    with pytest.raises(loopback.LoopbackUnavailable):
        cluster.start()
    assert _children() - before == set() and not (tmp_path / "run" / "etcd.log").exists()


def test_with_wildcards_allowed_it_starts_and_its_check_sees_them(no_compiler, model_dir,
                                                                  tmp_path):
    """The operator's opt-out does what it says: the master listens on every address, and
    the cluster's own check (what fails a start that is not allowed that) finds it."""
    with EmbeddedCluster(_no_engines(model_dir, tmp_path / "run", allow=True)) as cluster:
        wide = cluster.wide_listeners()
        assert cluster.master is not None
        assert cluster.master.http_port in {port for _, port, _ in wide}, wide
        assert sorted(wide) == sorted(_wide(listeners(_children())))


def test_the_launcher_says_why_it_refuses_and_how_to_opt_out(model_dir, tmp_path):
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"),
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-m", "embedded", "--model", model_dir,
                          "--run-dir", str(tmp_path / "run"), "--port", "0",
                          "--admin-port", "-1"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1, out
    assert "--allow-wildcard-binds" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "run" / "etcd.log").exists()


def test_a_listener_beyond_loopback_found_after_start_fails_it(model_dir, tmp_path,
                                                                monkeypatch):
    """The shim is built but does not take (the master started as if on another host): the
    cluster's check after start finds the wide listener, and the start fails and stops all."""
    real = loopback.env
    monkeypatch.setattr(loopback, "env",
                        lambda host, base=None, allow_wildcard=False: real("10.1.2.3", base))
    before = _children()
    cluster = EmbeddedCluster(_no_engines(model_dir, tmp_path / "run", allow=False))
    with pytest.raises(loopback.LoopbackUnavailable, match="listen beyond loopback"):
        cluster.start()
    assert _children() - before == set()
