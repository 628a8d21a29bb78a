"""Free loopback ports for servers started by the launcher and the tests."""

from __future__ import annotations

import contextlib
import random
import socket
from collections.abc import Collection


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (the caller binds it soon after)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports free on `host` now, all bound at once while chosen (one `free_port`
    after another could hand the same port out twice). They are drawn from below the kernel's
    ephemeral range: a port from that range, released here and bound by the caller a moment
    later, can meanwhile be taken by any process's outgoing connection (EADDRINUSE in a
    clean-clone CI run); ports below it go only to servers that ask for them by number."""
    low, high = _FIXED_RANGE[0], _ephemeral_start() - 1
    rng = random.SystemRandom()
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for _ in range(64 * n):
            if len(ports) == n:
                break
            port = rng.randint(low, high)
            if port in ports:
                continue
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                s.bind((host, port))
            except OSError:
                continue
            ports.append(port)
        if len(ports) < n:  # a crowded range: the kernel's choice, as before
            for _ in range(n - len(ports)):
                s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                s.bind((host, 0))
                ports.append(s.getsockname()[1])
        return ports


def ports_from(first: int, n: int, taken: Collection[int] = (), host: str = "127.0.0.1"
               ) -> list[int]:
    """`first` and the `n - 1` next ports above it free on `host` now and not in `taken`
    (`first` itself as given, unchecked: its server says if it is busy). `first` 0: `n` free
    ports (`free_ports`) none of them in `taken`."""
    if not first:
        return [p for p in free_ports(n + len(taken), host) if p not in taken][:n]
    ports = [first]
    port = first
    while len(ports) < n:
        port += 1
        if port >= 65536:
            raise OSError(f"no {n} free ports from {first} up")
        if port not in taken and _bindable(host, port):
            ports.append(port)
    return ports


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


_FIXED_RANGE = (20000, 32767)


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (the ports `bind(0)` and outgoing
    connections get)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            start = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        start = 32768
    return max(start, _FIXED_RANGE[0] + 1024)


def wait_for_port(host: str, port: int, timeout: float) -> bool:
    """Poll until something accepts TCP connections on host:port; False on timeout."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.1)
    return False
