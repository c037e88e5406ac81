"""TLS certificates and SuperNode keys for a Flower deployment.

A deployment with TLS needs three PEM files on the SuperLink (a CA certificate,
a server certificate signed by it whose subject alternative names list every
address the SuperLink is reached at, and the server's private key) and the CA
certificate on every SuperNode and on the machine that runs ``flwr run``.
SuperNode authentication needs one NIST elliptic-curve key pair per SuperNode in
OpenSSH format: the private key stays on the SuperNode
(``flower-supernode --auth-supernode-private-key``), the public key is
registered with ``flwr supernode register``.

:func:`generate_tls_certificates` and :func:`generate_supernode_keys` write
these files with the ``cryptography`` package. They are what the deployment
test uses; ``docs/deployment.md`` gives the equivalent ``openssl`` and
``ssh-keygen`` commands. Command line::

    python -m fedlr.flower.certs tls --out certs --host 203.0.113.10 --host 127.0.0.1
    python -m fedlr.flower.certs supernode-key --out keys supernode-0
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedlr.errors import DeploymentError

__all__ = [
    "SupernodeKeys",
    "TlsFiles",
    "generate_supernode_keys",
    "generate_tls_certificates",
]

_RSA_BITS = 2048
_CA_NAME = "fedlr deployment CA"
"""The common name of the CA that signs the SuperLink's certificate."""


@dataclass(frozen=True)
class TlsFiles:
    """Paths of the PEM files written by :func:`generate_tls_certificates`.

    Attributes
    ----------
    ca_cert : Path
        CA certificate: ``--ssl-ca-certfile`` of the SuperLink,
        ``--root-certificates`` of each SuperNode, ``root-certificates`` of the
        ``flwr`` CLI connection.
    server_cert : Path
        Server certificate signed by the CA: ``--ssl-certfile``.
    server_key : Path
        Server private key (mode 0600): ``--ssl-keyfile``.
    """

    ca_cert: Path
    server_cert: Path
    server_key: Path


@dataclass(frozen=True)
class SupernodeKeys:
    """Paths of one SuperNode's authentication key pair (OpenSSH format).

    Attributes
    ----------
    private_key : Path
        ``flower-supernode --auth-supernode-private-key`` (mode 0600).
    public_key : Path
        Argument of ``flwr supernode register``.
    """

    private_key: Path
    public_key: Path


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    if not host or any(c.isspace() for c in host) or "/" in host:
        raise DeploymentError(
            f"'{host}' is neither an IP address nor a DNS name; the certificate "
            "needs the addresses the SuperLink is reached at"
        )
    return x509.DNSName(host)


def _write_private(path: Path, data: bytes) -> None:
    """Write a private key readable by its owner only, from its first byte.

    The file is created with mode 0600 (never world-readable, not even
    briefly) and ``O_EXCL | O_NOFOLLOW``, so a symlink planted at ``path``
    is refused instead of followed. An existing regular file is replaced.

    Raises
    ------
    DeploymentError
        If ``path`` is a symlink or not a regular file.
    """
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise DeploymentError(
            f"refusing to write a private key to {path}: it is a symlink or not a "
            "regular file"
        )
    path.unlink(missing_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError as exc:  # something was planted since the unlink
        raise DeploymentError(
            f"refusing to write a private key to {path}: it appeared while writing"
        ) from exc
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedlr"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def generate_tls_certificates(
    out_dir: Path, hosts: Sequence[str] = ("127.0.0.1", "localhost"), *, days: int = 365
) -> TlsFiles:
    """Write a self-signed CA and a server certificate for the SuperLink.

    Parameters
    ----------
    out_dir : Path
        Folder to write ``ca.crt``, ``server.pem`` and ``server.key`` into
        (created if missing; existing files are overwritten).
    hosts : sequence of str
        Every IP address or DNS name the SuperLink is reached at. They become
        the server certificate's subject alternative names; the first is its
        common name. Keep ``127.0.0.1`` in the list: the SuperLink's own
        ServerApp process connects to it over the loopback address.
    days : int
        Validity of both certificates, from one hour ago.

    Returns
    -------
    TlsFiles
        The three paths.

    Raises
    ------
    DeploymentError
        If ``hosts`` is empty, a host is not an address or a name, or ``days``
        is not positive.
    """
    if not hosts:
        raise DeploymentError("hosts is empty: the certificate needs at least one")
    if days <= 0:
        raise DeploymentError(f"days must be positive, got {days}")
    names = [_general_name(h) for h in hosts]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
    until = now + dt.timedelta(days=days)

    ca_key, ca_cert = _ca_certificate(now, until)
    server_key, server_cert = _server_certificate(hosts[0], names, ca_key, now, until)

    files = TlsFiles(
        ca_cert=out / "ca.crt",
        server_cert=out / "server.pem",
        server_key=out / "server.key",
    )
    files.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.server_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    _write_private(
        files.server_key,
        server_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )
    return files


def _ca_certificate(
    now: dt.datetime, until: dt.datetime
) -> tuple[rsa.RSAPrivateKey, x509.Certificate]:
    """A self-signed CA certificate allowed to sign others, and its key."""
    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=_RSA_BITS)
    ca_name = _name(_CA_NAME)
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return ca_key, ca_cert


def _server_certificate(
    common_name: str,
    names: Sequence[x509.GeneralName],
    ca_key: rsa.RSAPrivateKey,
    now: dt.datetime,
    until: dt.datetime,
) -> tuple[rsa.RSAPrivateKey, x509.Certificate]:
    """The server certificate, signed by the CA, with ``names`` as SANs."""
    server_key = rsa.generate_private_key(public_exponent=65537, key_size=_RSA_BITS)
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(_CA_NAME))
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(until)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return server_key, server_cert


def generate_supernode_keys(out_dir: Path, name: str) -> SupernodeKeys:
    """Write one SuperNode's P-384 key pair in OpenSSH format.

    Equivalent to ``ssh-keygen -t ecdsa -b 384 -N "" -f OUT_DIR/NAME``.

    Parameters
    ----------
    out_dir : Path
        Folder to write ``NAME`` (private) and ``NAME.pub`` (public) into.
    name : str
        File stem, e.g. ``supernode-0``.

    Returns
    -------
    SupernodeKeys
        The two paths.

    Raises
    ------
    DeploymentError
        If ``name`` is empty or contains a path separator.
    """
    if not name or "/" in name or os.sep in name:
        raise DeploymentError(f"key name must be a plain file name, got '{name}'")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    keys = SupernodeKeys(private_key=out / name, public_key=out / f"{name}.pub")
    _write_private(
        keys.private_key,
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        ),
    )
    keys.public_key.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        + b"\n"
    )
    return keys


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: write TLS certificates or a SuperNode key pair.

    Returns
    -------
    int
        0 on success, 1 when an input is invalid.
    """
    parser = argparse.ArgumentParser(
        prog="python -m fedlr.flower.certs",
        description="Write TLS certificates or SuperNode keys for a deployment.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    tls = commands.add_parser("tls", help="CA + server certificate for the SuperLink")
    tls.add_argument("--out", type=Path, required=True, help="output folder")
    tls.add_argument(
        "--host",
        action="append",
        required=True,
        help="IP address or DNS name of the SuperLink (repeat; include 127.0.0.1)",
    )
    tls.add_argument("--days", type=int, default=365, help="validity in days")
    key = commands.add_parser("supernode-key", help="P-384 key pair of a SuperNode")
    key.add_argument("--out", type=Path, required=True, help="output folder")
    key.add_argument("name", help="file stem, e.g. supernode-0")
    args = parser.parse_args(argv)
    try:
        if args.command == "tls":
            files = generate_tls_certificates(args.out, args.host, days=args.days)
            paths = [files.ca_cert, files.server_cert, files.server_key]
        else:
            keys = generate_supernode_keys(args.out, args.name)
            paths = [keys.private_key, keys.public_key]
    except DeploymentError as err:
        sys.stderr.write(f"error: {err}\n")
        return 1
    sys.stdout.write("".join(f"{path}\n" for path in paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
