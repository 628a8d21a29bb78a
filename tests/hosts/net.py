"""Hosts on this machine: Linux network namespaces, each joined by a veth pair to a bridge in
the root namespace, each with its own address in a private range that exists only on that
bridge (nothing is routed anywhere else). Everything made here is named `kvh-*`, so that
`teardown` can remove what an earlier, interrupted run left behind."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass

PREFIX = "kvh"
BRIDGE = f"{PREFIX}-br"
SUBNET = ipaddress.ip_network("198.18.77.0/24")
"""From 198.18.0.0/15, the range set aside for benchmarking networks (RFC 2544): no real host
has these addresses, and the only route to them is the bridge made here."""
GATEWAY = SUBNET[1]
"""The bridge's own address: the root namespace, where the requests come from."""


@dataclass(frozen=True)
class Host:
    name: str
    """A, B, C..."""
    ns: str
    addr: str
    link: str
    """The root side of the host's veth pair: down cuts the host off from every other one."""


def run(*args: str, ns: str | None = None, check: bool = True, timeout: float = 30.0,
        env: dict[str, str] | None = None, input: str | None = None,
        cwd: str | None = None) -> subprocess.CompletedProcess:
    """`args` (inside namespace `ns`, if given); raises with its output on a non-zero exit
    when `check`."""
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                       input=input, cwd=cwd)
    if check and p.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: exit {p.returncode}\n{p.stdout}{p.stderr}")
    return p


def cannot_make_hosts() -> str | None:
    """Why this machine cannot make the hosts (None: it can)."""
    if os.geteuid() != 0:
        return "not root: network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN"
    probe = f"{PREFIX}-probe"
    try:
        run("ip", "netns", "add", probe)
    except (RuntimeError, FileNotFoundError, subprocess.TimeoutExpired) as e:
        return f"cannot make a network namespace: {e}"
    run("ip", "netns", "del", probe, check=False)
    for route in json.loads(run("ip", "-j", "-4", "route", "show", "table", "all").stdout):
        dst = route.get("dst", "")
        if dst in ("", "default") or route.get("dev") == BRIDGE:
            continue
        try:
            net = ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False)
        except ValueError:
            continue
        if net.overlaps(SUBNET):
            return f"{SUBNET} is already routed here ({dst} dev {route.get('dev')})"
    return None


def build(names: list[str]) -> list[Host]:
    """The bridge and one namespace per name, addressed from SUBNET (.11, .12, ...)."""
    run("ip", "link", "add", BRIDGE, "type", "bridge")
    run("ip", "addr", "add", f"{GATEWAY}/{SUBNET.prefixlen}", "dev", BRIDGE)
    run("ip", "link", "set", BRIDGE, "up")
    hosts = []
    for i, name in enumerate(names):
        low = name.lower()
        host = Host(name, f"{PREFIX}-{low}", str(SUBNET[11 + i]), f"{PREFIX}-{low}-br")
        inner = f"{PREFIX}-{low}-in"
        run("ip", "netns", "add", host.ns)
        run("ip", "link", "add", host.link, "type", "veth", "peer", "name", inner)
        run("ip", "link", "set", host.link, "master", BRIDGE)
        run("ip", "link", "set", host.link, "up")
        run("ip", "link", "set", inner, "netns", host.ns)
        run("ip", "link", "set", "lo", "up", ns=host.ns)
        run("ip", "link", "set", inner, "name", "eth0", ns=host.ns)
        run("ip", "addr", "add", f"{host.addr}/{SUBNET.prefixlen}", "dev", "eth0", ns=host.ns)
        run("ip", "link", "set", "eth0", "up", ns=host.ns)
        hosts.append(host)
    return hosts


def set_link(host: Host, up: bool) -> None:
    run("ip", "link", "set", host.link, "up" if up else "down")


def namespaces() -> list[str]:
    out = run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines()
            if line.split() and line.split()[0].startswith(f"{PREFIX}-")]


def links() -> list[str]:
    out = run("ip", "-j", "link", "show", check=False).stdout or "[]"
    return [link["ifname"] for link in json.loads(out) if link["ifname"].startswith(f"{PREFIX}-")]


def pids(ns: str) -> list[int]:
    out = run("ip", "netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def leftovers() -> list[str]:
    """What of ours is still on the machine: namespaces, links and processes in them."""
    found = [f"namespace {ns}" for ns in namespaces()] + [f"link {link}" for link in links()]
    for ns in namespaces():
        found += [f"process {pid} in {ns}" for pid in pids(ns)]
    return found


def teardown(grace_s: float = 10.0) -> list[str]:
    """Stop every process in our namespaces (SIGTERM, then SIGKILL after `grace_s`), delete
    the namespaces (their veth pairs go with them) and the bridge. Returns the leftovers."""
    victims = {pid for ns in namespaces() for pid in pids(ns)}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in victims:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while victims and time.monotonic() < deadline:
            victims = {p for p in victims if os.path.exists(f"/proc/{p}")
                       and not _zombie(p)}
            time.sleep(0.1)
        if not victims:
            break
    for ns in namespaces():
        run("ip", "netns", "del", ns, check=False)
    for link in links():
        run("ip", "link", "del", link, check=False)
    return leftovers()


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def listeners(ns: str) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every listening TCP socket in `ns`."""
    out = run("ss", "-Hltnp", ns=ns).stdout
    found = []
    for line in out.splitlines():
        cols = line.split()
        if len(cols) < 4:
            continue
        addr, _, port = cols[3].rpartition(":")
        proc = ""
        if "users:((" in line:
            proc = line.split('users:(("', 1)[1].split('"', 1)[0]
        found.append((addr.strip("[]"), int(port), proc))
    return found
