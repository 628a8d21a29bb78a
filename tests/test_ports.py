"""Ports for the servers the cluster starts (`cluster.ports`)."""

from cluster.ports import free_ports


def test_ports_chosen_together_are_distinct():
    ports = free_ports(64)
    assert len(set(ports)) == 64 and all(0 < p < 65536 for p in ports)
