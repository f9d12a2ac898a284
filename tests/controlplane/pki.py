"""The credentials a throwaway control plane needs, made at start: a CA, kube-apiserver's serving certificate,
an admin client certificate (group system:masters) and the service-account signing key pair.

ECDSA P-256 throughout: generating it takes microseconds where RSA takes tens of milliseconds, and every
component accepts it.
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

_VALID_FOR = datetime.timedelta(days=2)


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    ca_key: Path  # kept so a harness can sign more clients (the node tier's kubelet)
    serving_cert: Path
    serving_key: Path
    admin_cert: Path
    admin_key: Path
    service_account_key: Path  # private: kube-apiserver signs tokens, kube-controller-manager too
    service_account_pub: Path  # public: kube-apiserver verifies tokens


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attributes)


def _certificate(
    subject: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    usage: list[x509.ObjectIdentifier] | None = None,
    sans: list[x509.GeneralName] | None = None,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # tolerate a little clock skew
        .not_valid_after(now + _VALID_FOR)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=not ca,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=ca,
                crl_sign=ca,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    )
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_pki(directory: Path) -> Pki:
    """Write every file under `directory` (mode 0600 for keys) and say where they are."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("gpu-dra-agent-test-ca")
    ca = _certificate(ca_name, ca_key, ca_name, ca_key, ca=True)

    serving_key = ec.generate_private_key(ec.SECP256R1())
    serving = _certificate(
        _name("kube-apiserver"),
        serving_key,
        ca_name,
        ca_key,
        usage=[ExtendedKeyUsageOID.SERVER_AUTH],
        sans=[
            x509.DNSName("localhost"),
            x509.DNSName("kubernetes"),
            x509.DNSName("kubernetes.default"),
            x509.DNSName("kubernetes.default.svc"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.IPAddress(ipaddress.ip_address("10.0.0.1")),  # the `kubernetes` Service's cluster IP
        ],
    )
    admin_key = ec.generate_private_key(ec.SECP256R1())
    admin = _certificate(
        _name("admin", "system:masters"), admin_key, ca_name, ca_key, usage=[ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    service_account_key = ec.generate_private_key(ec.SECP256R1())

    def write(name: str, data: bytes, mode: int = 0o644) -> Path:
        path = directory / name
        path.write_bytes(data)
        path.chmod(mode)
        return path

    cert_pem = serialization.Encoding.PEM
    return Pki(
        ca_cert=write("ca.crt", ca.public_bytes(cert_pem)),
        ca_key=write("ca.key", _pem_key(ca_key), 0o600),
        serving_cert=write("apiserver.crt", serving.public_bytes(cert_pem)),
        serving_key=write("apiserver.key", _pem_key(serving_key), 0o600),
        admin_cert=write("admin.crt", admin.public_bytes(cert_pem)),
        admin_key=write("admin.key", _pem_key(admin_key), 0o600),
        service_account_key=write("sa.key", _pem_key(service_account_key), 0o600),
        service_account_pub=write(
            "sa.pub",
            service_account_key.public_key().public_bytes(cert_pem, serialization.PublicFormat.SubjectPublicKeyInfo),
        ),
    )
