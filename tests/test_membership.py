"""Membership against a real etcd: registration, lease expiry, and riding out an etcd outage."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aetcd
import pytest
from conftest import ETCD_FAST as FAST
from conftest import eventually, make_info

from cluster.etcd_server import EtcdServer
from cluster.instance import InstanceInfo
from cluster.membership import MembershipWatcher, Registration


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    server = EtcdServer(data_dir=tmp_path_factory.mktemp("etcd") / "data").start()
    yield server
    server.close()


@pytest.fixture
def prefix() -> str:
    """A fresh prefix per test, so tests sharing the module's etcd don't see each other."""
    return f"/kvcluster-test/{uuid.uuid4().hex[:8]}/instances/"


@pytest.fixture
async def closing() -> AsyncIterator[Callable[[Any], Any]]:
    """Register registrations/watchers to be closed at teardown, whatever the test did."""
    opened: list[Any] = []

    def add(obj: Any) -> Any:
        opened.append(obj)
        return obj

    yield add
    for obj in reversed(opened):
        await obj.close()


async def test_register_then_graceful_stop(
    etcd: EtcdServer, prefix: str, closing: Callable[[Any], Any]
) -> None:
    changes: list[dict[str, InstanceInfo]] = []

    async def on_change(members: dict[str, InstanceInfo]) -> None:
        changes.append(members)

    watcher = closing(MembershipWatcher(etcd.endpoint, prefix=prefix, on_change=on_change, **FAST))
    await watcher.start(timeout=5)
    assert watcher.synced and watcher.members() == {}

    info = make_info("p0")
    reg = closing(Registration(etcd.endpoint, info, prefix=prefix, ttl=5, **FAST))
    await reg.start(timeout=5)
    assert reg.registered and reg.key == f"{prefix}p0"
    assert await watcher.wait_for(lambda m: m.get("p0") == info, timeout=5)
    assert changes[-1] == {"p0": info}

    # A watcher started later gets the member from its initial snapshot.
    late = closing(MembershipWatcher(etcd.endpoint, prefix=prefix, **FAST))
    await late.start(timeout=5)
    assert late.members() == {"p0": info}

    t0 = time.monotonic()
    await reg.stop()
    assert await watcher.wait_for(lambda m: "p0" not in m, timeout=2)
    assert await late.wait_for(lambda m: m == {}, timeout=2)
    assert time.monotonic() - t0 < 2, "graceful stop must not wait for the 5 s lease"
    assert changes[-1] == {}


async def test_a_deleted_or_overwritten_registration_is_reasserted_within_a_ttl(
    etcd: EtcdServer, prefix: str, closing: Callable[[Any], Any]
) -> None:
    """While its worker lives and its lease is valid, a registration someone deleted, or
    overwrote with another value or with the same value on no lease (which would outlive the
    worker), is put back, on the worker's own lease, within one TTL."""
    ttl = 3
    watcher = closing(MembershipWatcher(etcd.endpoint, prefix=prefix, **FAST))
    await watcher.start(timeout=5)
    info = make_info("p0")
    reg = closing(Registration(etcd.endpoint, info, prefix=prefix, ttl=ttl, **FAST))
    await reg.start(timeout=5)
    assert await watcher.wait_for(lambda m: m.get("p0") == info, timeout=5)
    lease = reg.lease_id
    stranger = dataclasses.replace(info, max_model_len=16, block_size=64)
    async with aetcd.Client("127.0.0.1", etcd.client_port, timeout=2) as client:
        for damage in ("delete", "overwrite", "unleased"):
            if damage == "delete":
                await client.delete(reg.key.encode())
                assert await watcher.wait_for(lambda m: "p0" not in m, timeout=2)
            else:
                value = stranger.to_json() if damage == "overwrite" else info.to_json()
                await client.put(reg.key.encode(), value)
                if damage == "overwrite":
                    assert await watcher.wait_for(lambda m: m.get("p0") == stranger, timeout=2)
            t0 = time.monotonic()

            async def ours() -> bool:
                got = await client.get(reg.key.encode())
                return got is not None and got.value == info.to_json() and got.lease == lease

            while not await ours():
                assert time.monotonic() - t0 < ttl, f"{damage}: not re-asserted within {ttl}s"
                await asyncio.sleep(0.05)
            assert await watcher.wait_for(lambda m: m.get("p0") == info, timeout=1), damage
            assert reg.registered and reg.lease_id == lease, damage


@pytest.mark.slow
async def test_crashed_registration_expires(
    etcd: EtcdServer, prefix: str, closing: Callable[[Any], Any]
) -> None:
    watcher = closing(MembershipWatcher(etcd.endpoint, prefix=prefix, **FAST))
    await watcher.start(timeout=5)
    reg = closing(Registration(etcd.endpoint, make_info("d0", "decode"), prefix=prefix, ttl=2))
    await reg.start(timeout=5)
    assert await watcher.wait_for(lambda m: "d0" in m, timeout=5)
    await asyncio.sleep(1.0)  # a few keep-alives go through, so the lease outlives its first TTL

    await reg.abandon()  # the keep-alive stops; nothing is revoked
    t0 = time.monotonic()
    assert await watcher.wait_for(lambda m: "d0" not in m, timeout=2 + 2.5)
    elapsed = time.monotonic() - t0
    assert elapsed > 0.5, f"dropped after {elapsed:.2f}s: looks revoked, not expired"


async def test_watcher_ignores_malformed_entries(
    etcd: EtcdServer, prefix: str, closing: Callable[[Any], Any]
) -> None:
    watcher = closing(MembershipWatcher(etcd.endpoint, prefix=prefix, **FAST))
    await watcher.start(timeout=5)
    good = make_info("b0", "both")
    async with aetcd.Client("127.0.0.1", etcd.client_port, timeout=2) as client:
        await client.put(f"{prefix}junk".encode(), b"{not json")
        await client.put(f"{prefix}other".encode(), good.to_json())  # key != instance_id
        await client.put(f"{prefix}b0".encode(), good.to_json())
        assert await watcher.wait_for(lambda m: "b0" in m, timeout=5)
        assert watcher.members() == {"b0": good}
        await client.delete_prefix(prefix.encode())
    assert await watcher.wait_for(lambda m: m == {}, timeout=5)


@pytest.mark.slow
async def test_survives_etcd_outage(tmp_path: Path, closing: Callable[[Any], Any]) -> None:
    server = EtcdServer(data_dir=tmp_path / "etcd").start()
    try:
        watcher = closing(MembershipWatcher(server.endpoint, probe_interval=0.5, **FAST))
        await watcher.start(timeout=5)
        reg_a = closing(Registration(server.endpoint, make_info("a"), ttl=3, **FAST))
        reg_b = closing(Registration(server.endpoint, make_info("b", "decode"), ttl=2, **FAST))
        await reg_a.start(timeout=5)
        await reg_b.start(timeout=5)
        assert await watcher.wait_for(lambda m: set(m) == {"a", "b"}, timeout=5)
        lease_a = reg_a.lease_id

        server.stop()
        assert await eventually(lambda: not watcher.synced, timeout=3)
        assert await eventually(lambda: not reg_a.registered, timeout=3)
        await reg_b.abandon()  # b "crashes" while etcd is down
        await asyncio.sleep(2.5)  # longer than any lease TTL: serving keeps the last view
        assert set(watcher.members()) == {"a", "b"}

        server.restart()  # blocks ~1 s: same ports, same data (keys and leases) as before
        reg_c = closing(Registration(server.endpoint, make_info("c", "both"), ttl=3, **FAST))
        await reg_c.start(timeout=5)
        # a re-registers on a fresh lease; b's lease (renewed by etcd's restart) runs out.
        assert await watcher.wait_for(lambda m: set(m) == {"a", "c"}, timeout=10), watcher.members()
        assert watcher.synced
        assert await eventually(lambda: reg_a.registered, timeout=3)
        assert reg_a.lease_id != lease_a

        # Shutting down while etcd is gone is bounded, never a hang.
        server.kill()
        t0 = time.monotonic()
        await reg_c.stop()
        await reg_a.stop()
        await watcher.close()
        assert time.monotonic() - t0 < 2 * FAST["rpc_timeout"] + 1.5
        assert set(watcher.members()) == {"a", "c"}  # still readable after close
    finally:
        server.close()


def test_instance_info_json_round_trip() -> None:
    info = make_info("p1")
    assert InstanceInfo.from_json(info.to_json()) == info
    assert InstanceInfo.from_json(info.to_json().decode()) == info
    assert json.loads(info.to_json())["role"] == "prefill"
    assert info.can_prefill and not info.can_decode
    assert make_info("x", "both").can_decode
    probed = dataclasses.replace(info, prefill_probe_s=0.25)
    assert InstanceInfo.from_json(probed.to_json()).prefill_probe_s == 0.25
    old = json.loads(info.to_json())
    del old["prefill_probe_s"], old["side"]  # an older worker's registration
    assert InstanceInfo.from_json(json.dumps(old)).prefill_probe_s == 0.0
    assert not InstanceInfo.from_json(json.dumps(old)).side
    assert InstanceInfo.from_json(dataclasses.replace(info, side=True).to_json()).side


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(extra=1),  # unknown key
        lambda d: d.pop("model"),  # missing key
        lambda d: d.update(role="router"),
        lambda d: d.update(block_size="16"),
        lambda d: d.update(block_size=0),
        lambda d: d.update(capacity_tokens=True),
        lambda d: d.update(address="no-port"),
        lambda d: d.update(instance_id="a/b"),
        lambda d: d.update(prefill_probe_s=-1.0),
        lambda d: d.update(prefill_probe_s="0.2"),
        lambda d: d.update(prefill_probe_s=float("nan")),
        lambda d: d.update(side="yes"),
    ],
)
def test_instance_info_json_rejects_bad_input(mutate: Callable[[dict[str, Any]], Any]) -> None:
    obj = json.loads(make_info("p1").to_json())
    mutate(obj)
    with pytest.raises(ValueError):
        InstanceInfo.from_json(json.dumps(obj).encode())


@pytest.mark.parametrize("raw", [b"[]", b"not json", b"\xff\xfe", b"null"])
def test_instance_info_json_rejects_non_objects(raw: bytes) -> None:
    with pytest.raises(ValueError):
        InstanceInfo.from_json(raw)


def test_instance_info_validates_role() -> None:
    with pytest.raises(ValueError, match="role"):
        make_info("p2", role="router")
