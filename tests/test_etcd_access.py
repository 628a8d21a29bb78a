"""etcd with TLS, client certificates and auth (a real etcd): the access file a deployment
writes lets the cluster register and watch; a caller missing any part of it is refused and
writes nothing."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import aetcd
import pytest
from conftest import ETCD_FAST as FAST
from conftest import make_info

from cluster import etcd_auth
from cluster.certs import make_certs
from cluster.etcd_access import EtcdAccess
from cluster.etcd_server import EtcdServer
from cluster.membership import DEFAULT_PREFIX, MembershipWatcher, Registration
from cluster.ports import free_port


class Secured:
    def __init__(self, server: EtcdServer, access_file: Path, root_password: str) -> None:
        self.server = server
        self.access = EtcdAccess.load(server.endpoint, str(access_file))
        self.root = replace(self.access, user="root", password=root_password)


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    """A TLS etcd with auth turned on the way `deploy/etcd.sh` does (`cluster.etcd_auth`)."""
    root = tmp_path_factory.mktemp("etcd-secured")
    server = EtcdServer(data_dir=root / "data", tls=make_certs(root / "tls", ["127.0.0.1"]))
    try:
        server.start()
        assert etcd_auth.main(["--endpoint", server.endpoint, "--tls-dir", str(root / "tls"),
                               "--out", str(root / "access")]) == 0
        access_file = root / "access" / "access.toml"
        assert {p.stat().st_mode & 0o777 for p in access_file.parent.iterdir()} == {0o600}
        yield Secured(server, access_file, (root / "etcd-root.pw").read_text().strip())
    finally:
        server.close()


async def _get(access: EtcdAccess, key: str) -> bytes | None:
    client = access.client(2.0, {})
    try:
        got = await asyncio.wait_for(client.get(key.encode()), 10)
        return None if got is None else got.value
    finally:
        await client.close()


async def test_the_access_file_registers_and_watches(secured: Secured) -> None:
    assert secured.server.client_url.startswith("https://")
    info = make_info("p-tls")
    watcher = MembershipWatcher(secured.access, **FAST)
    registration = Registration(secured.access, info, ttl=5, **FAST)
    try:
        await watcher.start(timeout=5)
        await registration.start(timeout=5)
        assert await watcher.wait_for(lambda m: m.get("p-tls") == info, timeout=5)
        assert await _get(secured.root, f"{DEFAULT_PREFIX}p-tls") is not None
    finally:
        await registration.close()
        await watcher.close()


@pytest.mark.parametrize("who", ["no_tls", "no_client_cert", "no_user", "wrong_password",
                                 "outside_its_prefix"])
async def test_a_caller_without_the_access_is_refused_and_writes_nothing(
        secured: Secured, who: str) -> None:
    good = secured.access
    key = f"{DEFAULT_PREFIX}intruder-{who}"
    caller = {
        "no_tls": EtcdAccess(good.endpoint),
        "no_client_cert": replace(good, cert=None, key=None),
        "no_user": replace(good, user="", password=""),
        "wrong_password": replace(good, password="not-the-password"),
        "outside_its_prefix": good,
    }[who]
    if who == "outside_its_prefix":
        key = f"/elsewhere/intruder-{who}"
    client = caller.client(1.0, {})
    try:
        with pytest.raises(aetcd.exceptions.ClientError):
            await asyncio.wait_for(client.put(key.encode(), b"x"), 10)
    finally:
        await client.close()
    assert await _get(secured.root, key) is None


def test_access_file_errors_are_named(tmp_path: Path) -> None:
    path = tmp_path / "access.toml"
    path.write_text('ca_file = "missing.pem"\n')
    with pytest.raises(ValueError, match="ca_file"):
        EtcdAccess.load("127.0.0.1:2379", str(path))
    path.write_text('user = "u"\n')
    with pytest.raises(ValueError, match="user and password_file go together"):
        EtcdAccess.load("127.0.0.1:2379", str(path))
    path.write_text('usr = "u"\n')
    with pytest.raises(ValueError, match="unknown keys"):
        EtcdAccess.load("127.0.0.1:2379", str(path))
    assert EtcdAccess.load("127.0.0.1:2379", "") == EtcdAccess("127.0.0.1:2379")


async def test_deploy_etcd_sh_turns_tls_and_auth_on(tmp_path: Path) -> None:
    """`deploy/etcd.sh` with KVCLUSTER_ETCD_SECURE=1, as an operator runs it: the access
    directory it writes registers; a plain client is refused; `deploy/stop.sh` stops it."""
    repo = Path(__file__).resolve().parent.parent
    port, peer = free_port("127.0.0.1"), free_port("127.0.0.1")
    env = {**os.environ, "KVCLUSTER_PYTHON": sys.executable,
           "KVCLUSTER_STATE_DIR": str(tmp_path), "KVCLUSTER_LOG_DIR": str(tmp_path),
           "KVCLUSTER_ETCD_PORT": str(port), "KVCLUSTER_ETCD_PEER_PORT": str(peer),
           "KVCLUSTER_ETCD_SECURE": "1", "KVCLUSTER_START_CHECK_S": "1"}
    try:
        run = subprocess.run(["bash", str(repo / "deploy/etcd.sh")], env=env, timeout=60,
                             capture_output=True, text=True)
        assert run.returncode == 0, run.stdout + run.stderr
        access = EtcdAccess.load(f"127.0.0.1:{port}",
                                 str(tmp_path / "etcd-access" / "access.toml"))
        assert access.tls and access.user == "kvcluster"
        registration = Registration(access, make_info("p-deployed"), ttl=5, **FAST)
        try:
            await registration.start(timeout=10)
            assert registration.registered
        finally:
            await registration.close()
        plain = EtcdAccess(access.endpoint).client(1.0, {})
        try:
            with pytest.raises(aetcd.exceptions.ClientError):
                await asyncio.wait_for(plain.get(b"/kvcluster/"), 10)
        finally:
            await plain.close()
    finally:
        stop = subprocess.run(["bash", str(repo / "deploy/stop.sh"), "etcd"], env=env,
                              timeout=60, capture_output=True, text=True)
    assert stop.returncode == 0 and "etcd stopped" in stop.stdout, stop.stdout + stop.stderr
