"""`make test-hosts`'s own logic that can be checked without making hosts: when it skips, and
how it tells Mooncake's listeners from a worker's log (the run itself is `python -m
tests.hosts`, docs/hosts.md)."""

from __future__ import annotations

from tests.hosts import net
from tests.hosts.checks import MOONCAKE_LISTEN


def test_it_skips_saying_why_where_it_is_not_root(monkeypatch):
    monkeypatch.setattr(net.os, "geteuid", lambda: 1000)
    why = net.cannot_make_hosts()
    assert why is not None and "not root" in why


def test_the_ports_mooncake_says_it_listens_on_are_read_from_a_worker_log():
    log = """\
I1125 20:27:38.997704  3568 transfer_engine_impl.cpp:183] Transfer Engine RPC using new RPC \
mapping, listening on 198.18.77.13:16718
I1125 20:27:39.005131  3568 client_service.cpp:872] Transfer engine auto discovery is disabled
I1125 20:27:39.005743  3568 tcp_transport.cpp:391] TcpTransport: listen on port 15149
2026-11-25T20:27:41.240903Z [info] worker_ready address=198.18.77.13:37533
"""
    ports = {int(p) for groups in MOONCAKE_LISTEN.findall(log) for p in groups if p}
    assert ports == {16718, 15149}
