"""The embedded single-machine cluster (`python -m embedded`, what `make run` starts): etcd, the
Mooncake master, the workers in the machine's shape, and the conductor, as child processes of
one launcher (`embedded.launcher`). Tests and benchmarks start the same class."""

from embedded.launcher import ClusterSpec, EmbeddedCluster, spec_from_args

__all__ = ["ClusterSpec", "EmbeddedCluster", "spec_from_args"]
