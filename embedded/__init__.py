"""The embedded single-machine cluster (`python -m embedded`, what `make run` starts): etcd, the
Mooncake master, the workers in the machine's shape, and the conductor, as child processes of
one launcher (`embedded.launcher`; its command line: `embedded.command`). Tests and benchmarks
start the same class."""

from embedded.command import spec_from_args
from embedded.launcher import ClusterSpec, EmbeddedCluster

__all__ = ["ClusterSpec", "EmbeddedCluster", "spec_from_args"]
