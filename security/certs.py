"""A cluster's certificate authority and its members' certificates (``kvserve up``, ``kvserve certs``).

Each member gets a directory (``security.identity``: ``cert.pem``, ``key.pem``, ``ca.pem``) whose certificate
names its role and name (SAN URI ``kvserve://ROLE/NAME`` and DNS ``NAME.ROLE.kvserve``, ``ROLE.kvserve``)
and the addresses it serves on (SAN IP or DNS: 127.0.0.1 and localhost always), signed by the cluster CA.
Keys are ECDSA P-256 and never leave their directory (mode 0700, files 0600).

``kvserve up`` makes a CA per start and keeps its key in memory only. ``kvserve certs --out DIR --names ...``
makes a CA once (``DIR/ca/``: its key, and the cluster secret the members' credentials derive from: the
cluster token when one is set, else a new one) and a directory per member (``DIR/NAME/``: certificate, key,
CA and ``token``, that member's credential: the keys of its role only, ``security.keys``), for containers to mount
(docker-compose.yml: each its own volume); run again with new names, it adds members under the same CA and
secret. A member directory that exists empty (a volume's mount point) is filled in.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from security.identity import CA_FILE, CERT_FILE, KEY_FILE, Identity, check_name
from security.keys import ROLE_KEYS, Keyring

TOKEN_FILE = "token"  # a member directory's credential (``kvserve certs``)
CA_DIR, CA_KEY_FILE, SECRET_FILE = "ca", "ca.key", "cluster-secret"
DEFAULT_HOSTS = ("127.0.0.1", "localhost")


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())  # fmt: skip


@dataclass(frozen=True)
class ClusterCA:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @classmethod
    def new(cls, days: int = 365) -> ClusterCA:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"kvserve cluster CA {secrets.token_hex(4)}")])
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=days))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                             key_encipherment=False, data_encipherment=False, key_agreement=False,
                                             key_cert_sign=True, crl_sign=True, encipher_only=False,
                                             decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))  # fmt: skip
        return cls(key, cert)

    @classmethod
    def load(cls, directory: Path) -> ClusterCA:
        key = serialization.load_pem_private_key((directory / CA_KEY_FILE).read_bytes(), password=None)
        return cls(key, x509.load_pem_x509_certificate((directory / CA_FILE).read_bytes()))

    @property
    def cert_pem(self) -> bytes:
        return _pem(self.cert)

    def issue(self, identity: Identity, hosts: tuple[str, ...] = (), days: int = 365) -> tuple[bytes, bytes]:
        """(certificate, key) PEMs for ``identity``, serving on ``hosts`` (and ``DEFAULT_HOSTS``) too."""
        check_name(identity.name)
        key = ec.generate_private_key(ec.SECP256R1())
        role_name = Identity(identity.role).dns_name  # any member of the role: for a peer known by address only
        names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity.uri),
                                         x509.DNSName(identity.dns_name), x509.DNSName(role_name)]
        for host in dict.fromkeys([*DEFAULT_HOSTS, *hosts]):
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity.dns_name)]))
                .issuer_name(self.cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(min(now + datetime.timedelta(days=days), self.cert.not_valid_after_utc))
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.SubjectAlternativeName(names), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(self.key, hashes.SHA256()))  # fmt: skip
        return _pem(cert), _key_pem(key)


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file of mode 0600 (never through a file or link that already exists)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(data)


def write_member(directory: Path, ca: ClusterCA, identity: Identity, hosts: tuple[str, ...] = (),
                 credential: str | None = None, days: int = 365) -> Path:  # fmt: skip
    """Make ``directory`` (mode 0700; new, or empty) with ``identity``'s certificate, key and the CA (and its
    credential, the ``token`` file, when given); returns it."""
    directory.mkdir(mode=0o700, exist_ok=True)
    directory.chmod(0o700)
    cert, key = ca.issue(identity, hosts, days)
    for name, data in ((CERT_FILE, cert), (KEY_FILE, key), (CA_FILE, ca.cert_pem)):
        _write_private(directory / name, data)
    if credential is not None:
        _write_private(directory / TOKEN_FILE, credential.encode() + b"\n")
    return directory


def member_identity(spec: str) -> Identity:
    """``ROLE:NAME``, or ``NAME`` whose first word names its role (``decode-0``, ``prefill-a``, ``router``)."""
    role, _, name = spec.rpartition(":") if ":" in spec else (spec.split("-", 1)[0], "", spec)
    if role not in ROLE_KEYS:
        raise ValueError(f"cannot tell the role of {spec!r}: write ROLE:NAME with ROLE one of {tuple(ROLE_KEYS)}")
    return Identity(role, name)


def make_cluster_dir(out: Path, specs: list[str], hosts: tuple[str, ...] = (), days: int = 365,
                     secret: str | None = None) -> list[Path]:  # fmt: skip
    """``kvserve certs``: the CA and cluster secret (``secret``, else a new one) in ``out/ca`` (made once), and a
    directory per member of ``specs`` (``member_identity``) that ``out`` does not hold yet; returns the member
    directories made. ``ValueError`` when ``out/ca`` holds another secret than ``secret``."""
    identities = [member_identity(spec) for spec in specs]
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    ca_dir = out / CA_DIR
    if (ca_dir / CA_KEY_FILE).exists():
        ca, stored = ClusterCA.load(ca_dir), (ca_dir / SECRET_FILE).read_text().strip()
        if secret is not None and secret != stored:
            raise ValueError(f"{ca_dir} holds the credentials of another cluster token than the one set: remove "
                             f"{out} to make them anew")  # fmt: skip
        secret = stored
    else:
        ca, secret = ClusterCA.new(days), secret or secrets.token_urlsafe(32)
        ca_dir.mkdir(mode=0o700, exist_ok=True)
        ca_dir.chmod(0o700)
        _write_private(ca_dir / CA_KEY_FILE, _key_pem(ca.key))
        _write_private(ca_dir / CA_FILE, ca.cert_pem)
        _write_private(ca_dir / SECRET_FILE, secret.encode() + b"\n")
    keyring = Keyring.from_token(secret)
    return [write_member(out / i.name, ca, i, hosts, keyring.credential(i.role), days)
            for i in identities if not (out / i.name / CERT_FILE).exists()]  # fmt: skip
