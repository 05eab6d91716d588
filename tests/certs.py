"""Throwaway certificates for TLS tests: a CA and leaf certificates it signs, as PEM files.

Leaf certificates name localhost and 127.0.0.1 and are good for both server and client use, so one
certificate per service serves its port and authenticates it to the others (mTLS).
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from common.serving.tls import TlsConfig


@dataclass(frozen=True, slots=True)
class Issuer:
    cert_path: Path
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


@dataclass(frozen=True, slots=True)
class Leaf:
    cert_path: Path
    key_path: Path

    def tls(self, ca: Issuer, client_auth: bool = False) -> TlsConfig:
        return TlsConfig(tls_cert=str(self.cert_path), tls_key=str(self.key_path),
                         tls_ca=str(ca.cert_path), tls_client_auth=client_auth)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _validity(builder: x509.CertificateBuilder) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return builder.not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(
        now + datetime.timedelta(days=1))


def make_ca(directory: Path, name: str = "splitserve-test-ca") -> Issuer:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = _validity(x509.CertificateBuilder().subject_name(_name(name)).issuer_name(
        _name(name)).public_key(key.public_key()).serial_number(x509.random_serial_number()))
    cert = builder.add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True
                                 ).sign(key, hashes.SHA256())
    path = directory / f"{name}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return Issuer(path, cert, key)


def make_leaf(directory: Path, name: str, issuer: Issuer,
              hosts: tuple[str, ...] = ("localhost", "127.0.0.1")) -> Leaf:
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    builder = _validity(x509.CertificateBuilder().subject_name(_name(name)).issuer_name(
        issuer.cert.subject).public_key(key.public_key()).serial_number(
        x509.random_serial_number()))
    cert = (builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(issuer.key, hashes.SHA256()))
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return Leaf(cert_path, key_path)
