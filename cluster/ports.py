"""Free loopback ports for servers started by the launcher and the tests."""

from __future__ import annotations

import contextlib
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (the caller binds it soon after)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct free ports: all bound at once while chosen (one `free_port` after another
    can hand the same just-released port out twice: a master whose RPC and HTTP ports came out
    equal failed a clean-clone test run)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                 for _ in range(n)]
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]


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
