"""Ports for the servers and clients the cluster starts (`cluster.ports`)."""

import socket

from cluster.ports import fresh_port


def test_a_fresh_port_is_free_and_drawn_from_its_range():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        taken.listen()
        lo = busy - 1 if busy > 1024 else busy
        port = fresh_port("127.0.0.1", lo, busy)  # two candidates, one taken
        assert port == lo
