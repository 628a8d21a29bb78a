"""Turning etcd's auth on for a cluster: a root user, and one user confined to the cluster's keys.

`python -m cluster.etcd_auth --endpoint HOST:PORT [--tls-dir DIR] --out DIR` (what
`deploy/etcd.sh` runs once, when KVCLUSTER_ETCD_SECURE=1) enables auth on a fresh etcd and
writes the access directory every node uses (`cluster.etcd_access`): `access.toml`, the CA
and client pair copied from `--tls-dir`, and a new random password for user `kvcluster`,
whose role may read and write `/kvcluster/` and nothing else. The root password goes to
`etcd-root.pw` beside that directory, for the operator only. Files are mode 0600.
"""

from __future__ import annotations

import argparse
import secrets
import shutil
from pathlib import Path

import grpc
from aetcd import rpc  # aetcd's generated etcd v3 stubs

from cluster.certs import CertFiles
from cluster.etcd_access import EtcdAccess

USER = "kvcluster"
PREFIX = "/kvcluster/"
_T = 5.0


def enable_auth(access: EtcdAccess, user: str, password: str, prefix: str,
                ready_timeout: float = 20.0) -> str:
    """etcd auth on, at the etcd `access` reaches (waits up to `ready_timeout` for it to
    answer): `user` may read and write keys under `prefix`, nothing else; every call then
    needs a user. Returns the root user's new, random password (`auth enable` needs root)."""
    root_password = secrets.token_urlsafe(24)
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    perm = rpc.Permission(permType=rpc.Permission.READWRITE, key=prefix.encode(),
                          range_end=end.encode())
    with access.channel() as channel:
        grpc.channel_ready_future(channel).result(timeout=ready_timeout)
        auth = rpc.AuthStub(channel)
        auth.RoleAdd(rpc.AuthRoleAddRequest(name="root"), timeout=_T)
        auth.UserAdd(rpc.AuthUserAddRequest(name="root", password=root_password), timeout=_T)
        auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=_T)
        auth.RoleAdd(rpc.AuthRoleAddRequest(name=user), timeout=_T)
        auth.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(name=user, perm=perm),
                                 timeout=_T)
        auth.UserAdd(rpc.AuthUserAddRequest(name=user, password=password), timeout=_T)
        auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=user, role=user), timeout=_T)
        auth.AuthEnable(rpc.AuthEnableRequest(), timeout=_T)
    return root_password


def write_access(out: Path, tls: CertFiles | None, password: str) -> Path:
    """The access directory for `USER` with `password` (and `tls`'s CA and client pair)."""
    out.mkdir(parents=True, exist_ok=True)
    lines = [f'user = "{USER}"', 'password_file = "etcd.pw"']
    (out / "etcd.pw").write_text(password + "\n")
    if tls is not None:
        for name, src in (("ca_file", tls.ca), ("cert_file", tls.client_cert),
                          ("key_file", tls.client_key)):
            shutil.copyfile(src, out / src.name)
            lines.append(f'{name} = "{src.name}"')
    (out / "access.toml").write_text("\n".join(lines) + "\n")
    for path in out.iterdir():
        path.chmod(0o600)
    return out / "access.toml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", required=True, help="etcd host:port")
    parser.add_argument("--tls-dir", default="", help="`cluster.certs` output (TLS etcd)")
    parser.add_argument("--out", required=True, help="the access directory to write")
    args = parser.parse_args(argv)
    tls = None
    if args.tls_dir:
        tls = CertFiles.in_dir(Path(args.tls_dir))
    out = Path(args.out)
    password = secrets.token_urlsafe(24)
    root_password = enable_auth(EtcdAccess.from_certs(args.endpoint, tls), USER, password,
                                PREFIX)
    access = write_access(out, tls, password)
    root_file = out.parent / "etcd-root.pw"
    root_file.write_text(root_password + "\n")
    root_file.chmod(0o600)
    print(f"etcd auth enabled; access file: {access}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
