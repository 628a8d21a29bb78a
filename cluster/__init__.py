"""Code shared by every process of the cluster: membership, process supervision, ports, logging."""
