"""Keep servers that bind every address whatever they are told on loopback (`env`), or refuse
to start them (`LoopbackUnavailable`).

Mooncake 0.3.13 has no bind option for its transfer engines (handshake and TCP data
listeners) and ignores `--http_metadata_server_host`: without help, `make run` listened on
four wildcard sockets. A process started with `env(host)` for a loopback `host` gets
`loopback_bind.c` preloaded, which turns its wildcard binds into loopback ones and leaves
every other bind alone. The library is compiled from that source once, with the machine's C
compiler (`$CC`, else `cc`, else `gcc`), into the user's cache (a path named after the
source's digest).

Fails closed: where the shim cannot be built (no compiler, or it failed), `env` raises
`LoopbackUnavailable` for a loopback host, whose message says why and how to opt out;
`allow_wildcard=True` (the launcher's `--allow-wildcard-binds`) starts the process without
it, its listeners on every address, with a warning. `wide_listeners` finds what listens
beyond loopback after all: the embedded cluster checks its processes with it once started.

Only for hosts in `LOOPBACK`: a server meant to be reached from other hosts (`deploy/`
beyond loopback) keeps its wildcard binds. With the shim goes `MC_TCP_BIND_ADDRESS`: a
transfer engine otherwise tells its peers to reach it at the machine's first LAN address
(eth0's, say), where nothing listens once it is bound to loopback.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import psutil
import structlog

from cluster.cache import cache_dir
from cluster.secret import LOOPBACK

log = structlog.get_logger(__name__)

SOURCE = Path(__file__).with_name("loopback_bind.c")
OPT_OUT = "--allow-wildcard-binds"
"""The launcher's flag (and `python -m store.master`'s) that starts servers without the shim."""


class LoopbackUnavailable(Exception):
    """Servers meant for loopback would listen on every address, and the operator did not
    allow that."""


@dataclass(frozen=True)
class Shim:
    path: Path | None
    """The compiled library; None where it could not be built."""
    why_not: str = ""


@cache
def shim() -> Shim:
    """The shim, built on first use (once per process; `shim.cache_clear()` to look again)."""
    source = SOURCE.read_bytes()
    path = cache_dir() / f"loopback_bind-{hashlib.sha256(source).hexdigest()[:12]}.so"
    if path.is_file():
        return Shim(path)
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return Shim(None, "no C compiler ($CC, cc, gcc) to build it")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so")
    os.close(fd)
    try:
        subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", tmp, str(SOURCE), "-ldl"],
                       check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, path)  # atomic: concurrent builders each put a whole library there
    except (OSError, subprocess.SubprocessError) as e:
        Path(tmp).unlink(missing_ok=True)
        detail = (getattr(e, "stderr", "") or str(e)).strip().splitlines()
        return Shim(None, f"the C compiler {cc} failed to build it: "
                          f"{detail[-1] if detail else type(e).__name__}")
    return Shim(path)


def library(allow_wildcard: bool = False) -> Path | None:
    """The compiled shim. Where it cannot be built: `LoopbackUnavailable`, or None when
    `allow_wildcard` (logged)."""
    s = shim()
    if s.path is not None:
        return s.path
    if not allow_wildcard:
        raise LoopbackUnavailable(
            f"cannot keep Mooncake's servers on loopback: the bind shim ({SOURCE.name}) "
            f"is not available ({s.why_not}); without it mooncake_master and the transfer "
            "engines listen on every address. Install a C compiler (e.g. apt-get install "
            f"gcc, or set $CC), or start with {OPT_OUT} to accept that.")
    log.warning("wildcard_binds_allowed", reason=s.why_not,
                effect="Mooncake's servers listen on every address")
    return None


def env(host: str, base: Mapping[str, str] | None = None,
        allow_wildcard: bool = False) -> dict[str, str]:
    """`base` (default: this process's environment), with the shim preloaded if `host` is a
    loopback address; `LoopbackUnavailable` if it cannot be, unless `allow_wildcard`."""
    out = dict(os.environ if base is None else base)
    if host not in LOOPBACK:
        return out
    # the address a transfer engine advertises to its peers: else its first LAN address
    # (`findLocalIpAddresses`), where a loopback-bound listener cannot be reached
    out.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    lib = library(allow_wildcard)
    if lib is not None:
        out["LD_PRELOAD"] = " ".join(p for p in (str(lib), out.get("LD_PRELOAD", "")) if p)
    return out


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def wide_listeners(pids: Iterable[int]) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every listening TCP socket of the processes `pids` that is not
    on a loopback address (processes gone meanwhile are skipped)."""
    out = []
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.Error:
            continue
        out += [(c.laddr.ip, c.laddr.port, pid) for c in conns
                if c.status == psutil.CONN_LISTEN and not _is_loopback(c.laddr.ip)]
    return out
