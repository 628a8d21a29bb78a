"""Ports for the servers the cluster starts (`cluster.ports`)."""

from cluster.ports import free_ports


def test_ports_chosen_together_are_distinct():
    ports = free_ports(64)
    assert len(set(ports)) == 64 and all(0 < p < 65536 for p in ports)


async def test_a_worker_whose_port_was_taken_listens_on_another():
    """The launcher picks a worker's port ~40 s before the worker binds it (its engine loads
    first): a port taken meanwhile costs the worker nothing but the number."""
    import socket

    import grpc

    from worker.main import _bind

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    try:
        got = _bind(server, "127.0.0.1", port)
        assert got not in (0, port)
        await server.start()
        with socket.create_connection(("127.0.0.1", got), timeout=5):
            pass
    finally:
        await server.stop(None)
        taken.close()
