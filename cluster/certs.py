"""TLS material for a cluster's etcd or its worker plane: a private CA, a server certificate, a
client certificate.

`python -m cluster.certs --out DIR --host 10.0.0.1 [--host etcd.internal]` writes
`ca.pem`, `server.pem`/`server-key.pem` (valid for every `--host`, IP or DNS name) and
`client.pem`/`client-key.pem` (for etcd's `--client-cert-auth`; its CN `kvcluster-node` is no
etcd user on purpose: etcd takes a certificate's CN as the user when a call carries no
password, so a stolen client pair alone would otherwise be enough); keys are
mode 0600; a complete existing set is kept (re-running never rotates behind an operator's
back). The server pair also carries the client-auth usage: etcd 3.5's HTTP gateway dials
etcd itself with it under `--client-cert-auth`.
`deploy/etcd.sh` runs it when TLS is turned on; an operator with a real PKI brings their own
files instead. Every node needs `ca.pem` and the client pair; only etcd's node the server pair.
For the worker plane (`cluster.plane_tls`), `--host kvcluster-worker --name kvcluster-worker`:
a server pair every worker shares, the client pair the conductor's.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_DAYS = 825


@dataclass(frozen=True)
class CertFiles:
    """Where `make_certs` put (or found) each file."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    @classmethod
    def in_dir(cls, out: Path) -> CertFiles:
        return cls(out / "ca.pem", out / "server.pem", out / "server-key.pem",
                   out / "client.pem", out / "client-key.pem")


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _issue(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
           issuer_key: ec.EllipticCurvePrivateKey, *, ca: bool = False,
           hosts: tuple[str, ...] = (), usage: tuple[x509.ObjectIdentifier, ...] = ()
           ) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder()
               .subject_name(_name(subject)).issuer_name(issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=_DAYS))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if hosts:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage(list(usage)), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.write_bytes(data)
    if private:
        path.chmod(0o600)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_certs(out: str | Path, hosts: list[str], name: str = "kvcluster-etcd") -> CertFiles:
    """A CA and the server (for `hosts`, its subject `name`) and client pairs in `out`; kept
    if already there."""
    if not hosts:
        raise ValueError("at least one host (the address etcd's clients dial)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = CertFiles.in_dir(out)
    if all(p.exists() for p in vars(files).values()):
        return files
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _issue("kvcluster-ca", ca_key, _name("kvcluster-ca"), ca_key, ca=True)
    for subject, cert_path, key_path, names, usage in (
            (name, files.server_cert, files.server_key, tuple(hosts),
             (ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH)),
            ("kvcluster-node", files.client_cert, files.client_key, (),
             (ExtendedKeyUsageOID.CLIENT_AUTH,))):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _issue(subject, key, ca.subject, ca_key, hosts=names, usage=usage)
        _write(cert_path, cert.public_bytes(serialization.Encoding.PEM))
        _write(key_path, _pem_key(key), private=True)
    _write(files.ca, ca.public_bytes(serialization.Encoding.PEM))
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for the PEM files")
    parser.add_argument("--host", action="append", required=True,
                        help="an address or name the server is dialled at (repeatable)")
    parser.add_argument("--name", default="kvcluster-etcd",
                        help="the server certificate's subject (kvcluster-etcd)")
    args = parser.parse_args(argv)
    files = make_certs(args.out, args.host, args.name)
    print(f"TLS material for {args.name} in {files.ca.parent}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
