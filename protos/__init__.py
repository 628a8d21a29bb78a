"""gRPC contracts: `worker.proto` (conductor <-> worker) and `admin.proto` (operators).

The stubs are generated from the .proto files (by `make`, or here on first import when they
are missing or older than their .proto), so the .proto files are the only source.
"""

from __future__ import annotations

import fcntl
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_PROTOS = ("worker", "admin")


def _stale(name: str) -> bool:
    src = _HERE / f"{name}.proto"
    outs = [_HERE / f"{name}_pb2.py", _HERE / f"{name}_pb2_grpc.py"]
    return any(not o.exists() or o.stat().st_mtime < src.stat().st_mtime for o in outs)


def generate(force: bool = False) -> None:
    """(Re)generate the Python stubs next to the .proto files."""
    names = [n for n in _PROTOS if force or _stale(n)]
    if not names:
        return
    from grpc_tools import protoc

    root = _HERE.parent
    with open(_HERE / ".generate.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for name in names:
            if not force and not _stale(name):
                continue
            args = ["protoc", f"-I{root}", f"--python_out={root}", f"--pyi_out={root}",
                    f"--grpc_python_out={root}", f"protos/{name}.proto"]
            if protoc.main(args) != 0:
                raise RuntimeError(f"protoc failed for protos/{name}.proto")


generate()

from protos import admin_pb2, admin_pb2_grpc, worker_pb2, worker_pb2_grpc  # noqa: E402

__all__ = ["admin_pb2", "admin_pb2_grpc", "worker_pb2", "worker_pb2_grpc", "generate"]
