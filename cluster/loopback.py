"""Keep servers that bind every address whatever they are told on loopback (`env`).

Mooncake 0.3.13 has no bind option for its transfer engines (handshake and TCP data
listeners) and ignores `--http_metadata_server_host`: without help, `make run` listened on
four wildcard sockets. A process started with `env(host)` for a loopback `host` gets
`loopback_bind.c` preloaded, which turns its wildcard binds into loopback ones and leaves
every other bind alone. The library is compiled from that source once, with the machine's C
compiler, into the user's cache (a path named after the source's digest). Without a compiler
the process starts as before, its listeners wide, and the launcher says so once.

Only for hosts in `LOOPBACK`: a server meant to be reached from other hosts (`deploy/`
beyond loopback) keeps its wildcard binds. With the shim goes `MC_TCP_BIND_ADDRESS`: a
transfer engine otherwise tells its peers to reach it at the machine's first LAN address
(measured: eth0's 192.0.2.2 here), where nothing listens once it is bound to loopback.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from functools import cache
from pathlib import Path

import structlog

from cluster.cache import cache_dir
from cluster.secret import LOOPBACK

log = structlog.get_logger(__name__)

SOURCE = Path(__file__).with_name("loopback_bind.c")


@cache
def library() -> Path | None:
    """The compiled shim, built on first use; None (logged) where no C compiler works."""
    source = SOURCE.read_bytes()
    path = cache_dir() / f"loopback_bind-{hashlib.sha256(source).hexdigest()[:12]}.so"
    if path.is_file():
        return path
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("loopback_shim_unavailable", reason="no C compiler (cc, gcc, $CC)",
                    effect="Mooncake's servers listen on every address")
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so")
    os.close(fd)
    try:
        subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", tmp, str(SOURCE), "-ldl"],
                       check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, path)  # atomic: concurrent builders each put a whole library there
    except (OSError, subprocess.SubprocessError) as e:
        Path(tmp).unlink(missing_ok=True)
        log.warning("loopback_shim_unavailable", reason=str(getattr(e, "stderr", "") or e),
                    effect="Mooncake's servers listen on every address")
        return None
    return path


def env(host: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment), with the shim preloaded if `host` is a
    loopback address and the shim is available."""
    out = dict(os.environ if base is None else base)
    if host not in LOOPBACK:
        return out
    # the address a transfer engine advertises to its peers: else its first LAN address
    # (`findLocalIpAddresses`), where a loopback-bound listener cannot be reached
    out.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    lib = library()
    if lib is not None:
        out["LD_PRELOAD"] = " ".join(p for p in (str(lib), out.get("LD_PRELOAD", "")) if p)
    return out
