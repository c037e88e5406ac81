"""Deployment helpers: certificates, SuperNode keys, SuperLink connections."""

from __future__ import annotations

import ipaddress
import socket
import ssl
import stat
import threading
import tomllib
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    PublicFormat,
    load_ssh_private_key,
)

from fedlr.errors import DeploymentError
from fedlr.flower.certs import (
    generate_supernode_keys,
    generate_tls_certificates,
    main,
)
from fedlr.launch.flwr_run import write_superlink_connection


def _load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _handshake(files, server_hostname: str) -> None:
    """One TLS handshake on 127.0.0.1 with the generated server certificate."""
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(files.server_cert, files.server_key)
    client_ctx = ssl.create_default_context(cafile=str(files.ca_cert))
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(10)
        port = listener.getsockname()[1]

        def serve() -> None:
            try:
                conn, _ = listener.accept()
                with server_ctx.wrap_socket(conn, server_side=True) as tls:
                    tls.recv(1)
            except (OSError, ssl.SSLError):
                pass

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            with (
                socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
                client_ctx.wrap_socket(raw, server_hostname=server_hostname) as tls,
            ):
                tls.sendall(b"x")
        finally:
            thread.join(timeout=10)


def test_server_certificate_is_signed_by_the_ca_with_the_hosts_as_sans(tmp_path):
    hosts = ["10.1.2.3", "superlink.example.org", "127.0.0.1", "localhost"]
    files = generate_tls_certificates(tmp_path, hosts, days=30)
    ca, server = _load(files.ca_cert), _load(files.server_cert)
    server.verify_directly_issued_by(ca)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address("10.1.2.3"),
        ipaddress.ip_address("127.0.0.1"),
    }
    assert set(san.get_values_for_type(x509.DNSName)) == {
        "superlink.example.org",
        "localhost",
    }
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    lifetime = server.not_valid_after_utc - server.not_valid_before_utc
    assert 30 <= lifetime.days <= 31
    assert stat.S_IMODE(files.server_key.stat().st_mode) == 0o600


def test_another_ca_does_not_verify_the_server_certificate(tmp_path):
    first = generate_tls_certificates(tmp_path / "a")
    second = generate_tls_certificates(tmp_path / "b")
    with pytest.raises(InvalidSignature):
        _load(first.server_cert).verify_directly_issued_by(_load(second.ca_cert))


@pytest.mark.parametrize("hostname", ["127.0.0.1", "localhost"])
def test_tls_handshake_succeeds_for_the_default_hosts(tmp_path, hostname):
    _handshake(generate_tls_certificates(tmp_path), hostname)


def test_tls_handshake_fails_for_a_host_not_in_the_certificate(tmp_path):
    files = generate_tls_certificates(tmp_path, ["localhost"])
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(files, "127.0.0.1")


@pytest.mark.parametrize(
    ("hosts", "days", "match"),
    [
        ([], 10, "empty"),
        (["bad host"], 10, "bad host"),
        (["a/b"], 10, "a/b"),
        (["127.0.0.1"], 0, "days"),
    ],
)
def test_bad_certificate_inputs_raise(tmp_path, hosts, days, match):
    with pytest.raises(DeploymentError, match=match):
        generate_tls_certificates(tmp_path, hosts, days=days)


def test_supernode_keys_are_a_p384_openssh_pair_flower_accepts(tmp_path):
    from flwr.cli.supernode.register import try_load_public_key

    keys = generate_supernode_keys(tmp_path, "supernode-0")
    private = load_ssh_private_key(keys.private_key.read_bytes(), None)
    assert isinstance(private, ec.EllipticCurvePrivateKey)
    assert isinstance(private.curve, ec.SECP384R1)
    public_line = keys.public_key.read_text().strip()
    assert public_line.startswith("ecdsa-sha2-nistp384 ")
    expected = private.public_key().public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH)
    assert public_line.encode() == expected
    assert try_load_public_key(keys.public_key)  # what `flwr supernode register` reads
    assert stat.S_IMODE(keys.private_key.stat().st_mode) == 0o600
    other = generate_supernode_keys(tmp_path, "supernode-1")
    assert other.public_key.read_bytes() != keys.public_key.read_bytes()


@pytest.mark.parametrize("name", ["", "a/b"])
def test_bad_key_names_raise(tmp_path, name):
    with pytest.raises(DeploymentError, match="file name"):
        generate_supernode_keys(tmp_path, name)


def test_superlink_connection_is_what_flower_reads(tmp_path, monkeypatch):
    from flwr.cli.flower_config import read_superlink_connection

    ca = generate_tls_certificates(tmp_path / "certs").ca_cert
    home = tmp_path / "home"
    write_superlink_connection(home, "site-a", "10.0.0.5:8000", root_certificates=ca)
    path = write_superlink_connection(home, "lab", "127.0.0.1:9000", insecure=True)
    data = tomllib.loads(path.read_text())
    assert data["superlink"]["default"] == "local"
    assert data["superlink"]["local"] == {"address": ":local:"}
    assert set(data["superlink"]) == {"default", "local", "site-a", "lab"}

    monkeypatch.setenv("FLWR_HOME", str(home))
    site = read_superlink_connection("site-a")
    assert site.address == "10.0.0.5:8000"
    assert site.root_certificates == str(ca.resolve())
    assert not site.insecure
    assert read_superlink_connection("lab").insecure

    write_superlink_connection(home, "site-a", "10.0.0.6:8000", root_certificates=ca)
    assert read_superlink_connection("site-a").address == "10.0.0.6:8000"


@pytest.mark.parametrize(
    ("name", "address", "kwargs", "match"),
    [
        ("bad name", "127.0.0.1:9000", {}, "connection name"),
        ("ok", "127.0.0.1", {}, "HOST:PORT"),
        ("ok", "127.0.0.1:0", {}, "HOST:PORT"),
        ("ok", ":9000", {}, "HOST:PORT"),
        ("ok", "127.0.0.1:9000", {"insecure": True, "root_certificates": Path("x")},
         "exclude"),
    ],
)  # fmt: skip
def test_bad_superlink_connections_raise(tmp_path, name, address, kwargs, match):
    with pytest.raises(DeploymentError, match=match):
        write_superlink_connection(tmp_path, name, address, **kwargs)


def test_command_line_writes_the_files(tmp_path, capsys):
    assert main(["tls", "--out", str(tmp_path), "--host", "10.0.0.5"]) == 0
    assert main(["supernode-key", "--out", str(tmp_path), "node-a"]) == 0
    printed = capsys.readouterr().out.split()
    names = {"ca.crt", "server.pem", "server.key", "node-a", "node-a.pub"}
    assert {Path(p).name for p in printed} == names
    assert all(Path(p).is_file() for p in printed)
    san = _load(tmp_path / "server.pem").extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    assert san.value.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("10.0.0.5")
    ]
    assert main(["tls", "--out", str(tmp_path), "--host", "no good"]) == 1
    assert "no good" in capsys.readouterr().err


def test_private_key_writer_refuses_a_planted_symlink_and_never_widens(tmp_path):
    import os

    victim = tmp_path / "victim.txt"
    victim.write_text("do not overwrite")
    out = tmp_path / "keys"
    out.mkdir()
    os.symlink(victim, out / "supernode-0")  # where the private key would go
    with pytest.raises(DeploymentError, match="symlink"):
        generate_supernode_keys(out, "supernode-0")
    assert victim.read_text() == "do not overwrite"
    os.unlink(out / "supernode-0")
    # Created 0600 from the start, whatever the umask; regenerating replaces it.
    old = os.umask(0)
    try:
        first = generate_supernode_keys(out, "supernode-0")
        second = generate_supernode_keys(out, "supernode-0")
    finally:
        os.umask(old)
    assert stat.S_IMODE(second.private_key.stat().st_mode) == 0o600
    assert first.private_key == second.private_key
