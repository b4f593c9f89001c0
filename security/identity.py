"""Who a cluster certificate names, and who is at the other end of an internal call.

A cluster certificate (``security.certs`` issues them: ``kvserve up`` for its children, ``kvserve certs`` for
containers) names one member by role and name twice:

* a SAN URI ``kvserve://ROLE/NAME`` (``decode`` and ``decode-0``), which a server reads from the caller's
  certificate to decide what it may call (``security.auth``: Decode <- router, Prefill <- decode,
  KVTransfer <- prefill);
* a SAN DNS name ``NAME.ROLE.kvserve``, which a client asks TLS to verify (``grpc.ssl_target_name_override``),
  so that it talks only to the member it meant: the router to the decode worker it picked, the decode worker
  to the prefill worker it leased blocks to. ``ROLE.kvserve`` names any member of a role, for a peer dialled
  by address alone (the router's static ``--decode-address``).

The worker id is the name, so worker ids of a cluster with certificates are DNS labels (``check_name``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import grpc

# A member's directory (``kvserve certs``, ``--cluster-certs``): its certificate and key, and the cluster CA's.
CERT_FILE, KEY_FILE, CA_FILE = "cert.pem", "key.pem", "ca.pem"
ROLES = ("router", "decode", "prefill", "launcher")  # the launcher (``kvserve up``) only checks health
URI_SCHEME = "kvserve://"
DNS_SUFFIX = ".kvserve"
_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")


def check_name(name: str) -> None:
    """Raise ``ValueError`` unless ``name`` can name a member: a DNS label (lower-case letters, digits, '-')."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"{name!r} cannot name a cluster member in a certificate: use lower-case letters, digits "
                         "and '-' (at most 63), starting and ending with a letter or digit")  # fmt: skip


@dataclass(frozen=True)
class Identity:
    """A member's role and name; ``name`` '' stands for any member of ``role`` (as a peer to expect). Names in
    certificates are checked when issued (``check_name``)."""

    role: str
    name: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")

    @property
    def uri(self) -> str:
        return f"{URI_SCHEME}{self.role}/{self.name}"

    @property
    def dns_name(self) -> str:
        return f"{self.name}.{self.role}{DNS_SUFFIX}" if self.name else f"{self.role}{DNS_SUFFIX}"

    def __str__(self) -> str:
        return f"{self.role} {self.name or '(any)'}"


def parse_uri(uri: str) -> Identity | None:
    """The identity a ``kvserve://ROLE/NAME`` URI names; None for any other text."""
    if not uri.startswith(URI_SCHEME):
        return None
    role, _, name = uri[len(URI_SCHEME) :].partition("/")
    try:
        return Identity(role, name) if name else None
    except ValueError:
        return None


def identity_of_cert(cert_pem: bytes) -> Identity | None:
    """The identity a PEM certificate's SAN URI names, or None when it names none (not a cluster certificate)."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    found = [i for uri in san.get_values_for_type(x509.UniformResourceIdentifier) if (i := parse_uri(uri))]
    return found[0] if len(found) == 1 else None


def peer_identity(context: grpc.aio.ServicerContext) -> Identity | None:
    """Who called: the identity in the certificate the caller presented (TLS verified it against the cluster CA
    before the call reached us), or None when it presented none that names one."""
    uris = context.auth_context().get("peer_uri", [])
    found = [i for uri in uris if (i := parse_uri(uri.decode(errors="replace")))]
    return found[0] if len(found) == 1 else None


def read_member_dir(directory: Path) -> dict:
    """``Security`` fields from a member's directory: its certificate, key and CA, and whom the certificate
    names. ``ValueError`` when a file is missing, the certificate names no member, or the key is not private
    to this user (mode 600, owned by this user or root), as ssh refuses such a key."""
    try:
        cert, ca = (directory / CERT_FILE).read_bytes(), (directory / CA_FILE).read_bytes()
        with open(directory / KEY_FILE, "rb") as file:
            info = os.fstat(file.fileno())
            key = file.read()
    except OSError as err:
        raise ValueError(f"cluster certificate directory {directory}: {err.strerror}: {err.filename}") from None
    if info.st_uid not in (os.getuid(), 0) or info.st_mode & 0o077:
        raise ValueError(f"{directory / KEY_FILE} must be private to this user (owner uid {info.st_uid}, mode "
                         f"{info.st_mode & 0o777:04o}): chmod 600 it")  # fmt: skip
    identity = identity_of_cert(cert)
    if identity is None:
        raise ValueError(f"{directory / CERT_FILE} names no cluster member (no kvserve:// URI): make it with "
                         "kvserve certs")  # fmt: skip
    return {"tls_cert": cert, "tls_key": key, "tls_ca": ca, "identity": identity}
