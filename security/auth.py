"""Who may call whom: cluster certificates (mutual TLS), keys per purpose, and the token-only fallback.

Trust model:

* The internal services (``Decode``, ``Prefill``, ``KVTransfer``) serve cluster members only, each the
  members of one role (``security.interceptor``): Decode the router, Prefill decode workers, KVTransfer prefill
  workers. Health and reflection stay open, and so does the router's public ``Inference`` service.
* With cluster certificates (``--cluster-certs DIR``: ``kvserve up`` makes them for its children,
  ``kvserve certs`` for containers), internal gRPC runs over mutual TLS: a server admits only callers with a
  certificate of the cluster CA, whose role it reads from the certificate, and a client verifies that the
  server's certificate names the member it meant to reach (``security.identity``), so a process that binds a
  dead worker's port gets no byte of a call. No token goes on the wire then.
* The keys come from the cluster token: ``KVSERVE_CLUSTER_TOKEN`` or a file (``--cluster-token-file`` /
  ``KVSERVE_CLUSTER_TOKEN_FILE``), never from a command line ``ps`` would show. It is the cluster secret,
  from which every key derives, or a credential holding one role's keys only (``security.keys``: the router's
  cannot sign a lease). Without certificates, a caller sends its role's call token instead (token-only
  mode). Without a token a process refuses to start unless ``--insecure-internal`` says so explicitly
  (and then it logs a warning).
* ``--tls-cert/--tls-key[/--tls-ca]`` serve the router's public port with (m)TLS; on a process without
  ``--cluster-certs`` they serve its internal port too (plain (m)TLS: no roles, token-only checks on top).
* Records that workers publish through Redis (worker entries, leases) and the lease a decode worker
  hands a prefill worker carry an HMAC under their purpose's key (``sign``/``verify``), so a process that
  can write to Redis but does not hold the key cannot pose as a worker or grant itself KV blocks.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Protocol

import grpc

from security.identity import Identity, read_member_dir
from security.interceptor import CALLER_METADATA, ROLE_METADATA, TOKEN_METADATA, CallerInterceptor
from security.keys import MEMBER, Keyring

__all__ = ["CALLER_METADATA", "TOKEN_METADATA", "Security", "load_token", "security_from_settings"]

TOKEN_ENV = "KVSERVE_CLUSTER_TOKEN"
TOKEN_FILE_ENV = "KVSERVE_CLUSTER_TOKEN_FILE"
MAX_MESSAGE_BYTES = 64 << 20
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A peer that restarted (same address) is called again within a second of serving: gRPC's default
    # reconnect backoff grows to 120 s, and a channel to a restarted worker sat in it for seconds.
    # (not min_reconnect_backoff_ms: gRPC also takes it as the connect timeout)
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Security:
    """A process's credentials: the cluster token (``None`` only with ``--insecure-internal``) and the TLS files
    of its internal port; ``identity`` is whom ``tls_cert`` names when it is a cluster certificate (then calls
    are authorized by the certificates' roles, and clients verify whom they reach)."""

    token: str | None
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    tls_ca: bytes | None = None
    identity: Identity | None = None

    def __repr__(self) -> str:  # never the token or the private key: a repr ends up in logs and tracebacks
        token = None if self.token is None else "<hidden>"
        return f"Security(token={token}, tls={self.tls}, mutual_tls={self.tls_ca is not None})"

    @classmethod
    def insecure(cls) -> Security:
        return cls(token=None)

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @cached_property
    def keyring(self) -> Keyring:
        """The keys the token holds (``security.keys``); ``ValueError`` for a credential that does not parse."""
        return Keyring.from_token(self.token)

    def credential(self, role: str) -> str:
        """A token holding ``role``'s keys only, for a process of that role (the cluster secret's holder only)."""
        return self.keyring.credential(role)

    # -- calls ------------------------------------------------------------------------------------------

    def metadata(self, caller: str = "") -> tuple[tuple[str, str], ...]:
        """Call metadata for an internal call made by worker ``caller``: with cluster certificates nothing
        secret (the certificate speaks for us), else our role's call token."""
        items = []
        if self.identity is None and self.token is not None:
            items += [(TOKEN_METADATA, self.keyring.call_token), (ROLE_METADATA, self.keyring.role)]
        if caller:
            items.append((CALLER_METADATA, caller))
        return tuple(items)

    def aio_channel(self, address: str, peer: Identity | None = None) -> grpc.aio.Channel:
        """A channel to ``address``; with cluster certificates and ``peer``, TLS accepts only a server whose
        certificate names ``peer`` (else one of the cluster CA that names the address)."""
        if self.tls:
            return grpc.aio.secure_channel(address, self._channel_credentials(), options=self._options(peer))
        return grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)

    def channel(self, address: str, peer: Identity | None = None) -> grpc.Channel:
        if self.tls:
            return grpc.secure_channel(address, self._channel_credentials(), options=self._options(peer))
        return grpc.insecure_channel(address, options=GRPC_OPTIONS)

    def _options(self, peer: Identity | None) -> list[tuple[str, object]]:
        if self.identity is None or peer is None:
            return GRPC_OPTIONS
        return [*GRPC_OPTIONS, ("grpc.ssl_target_name_override", peer.dns_name)]

    def _channel_credentials(self) -> grpc.ChannelCredentials:
        mutual = self.tls_ca is not None
        return grpc.ssl_channel_credentials(root_certificates=self.tls_ca,
                                            private_key=self.tls_key if mutual else None,
                                            certificate_chain=self.tls_cert if mutual else None)  # fmt: skip

    # -- serving ----------------------------------------------------------------------------------------

    def bind(self, server: grpc.aio.Server, address: str) -> int:
        """Bind ``address`` with TLS when configured; returns the port (raises when it cannot listen)."""
        if self.tls:
            creds = grpc.ssl_server_credentials([(self.tls_key, self.tls_cert)], root_certificates=self.tls_ca,
                                                require_client_auth=self.tls_ca is not None)  # fmt: skip
            port = server.add_secure_port(address, creds)
        else:
            port = server.add_insecure_port(address)
        if port == 0:
            raise RuntimeError(f"cannot listen on {address}")
        return port

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [] if self.token is None and self.identity is None else [CallerInterceptor(self)]

    # -- signatures -------------------------------------------------------------------------------------

    def sign(self, purpose: str, *parts: object) -> str:
        """HMAC-SHA256 of ``purpose`` and ``parts`` under the purpose's key (``security.keys``; '' when insecure:
        integrity against mistakes only); ``PermissionError`` when our credential holds no such key."""
        return self.keyring.sign(purpose, *parts)

    def verify(self, signature: str, purpose: str, *parts: object) -> bool:
        return self.keyring.verify(signature, purpose, *parts)


# -- configuration ------------------------------------------------------------------------------------------


class SecuritySettings(Protocol):
    """What a process's security flags and ``KVSERVE_*`` variables say (``rpc.options.SecuritySettings``)."""

    cluster_token_file: str | None
    cluster_certs: str | None
    insecure_internal: bool
    tls_cert: str | None
    tls_key: str | None
    tls_ca: str | None


def tls_files(settings: SecuritySettings) -> dict[str, bytes]:
    """The ``--tls-*`` files as ``Security`` fields; ``ValueError`` for an incomplete set."""
    if bool(settings.tls_cert) != bool(settings.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    if settings.tls_ca and not settings.tls_cert:
        raise ValueError("--tls-ca needs --tls-cert and --tls-key (mutual TLS)")
    paths = (("tls_cert", settings.tls_cert), ("tls_key", settings.tls_key), ("tls_ca", settings.tls_ca))
    return {name: Path(path).read_bytes() for name, path in paths if path}


def security_from_settings(settings: SecuritySettings, role: str | None = None) -> Security:
    """The credentials of this process's internal calls, from its security settings (flags, ``KVSERVE_*``)
    and ``$KVSERVE_CLUSTER_TOKEN``; ``ValueError`` says what is missing or wrong. ``role`` is the process's: a
    certificate or credential of another is refused."""
    files: dict[str, object] = tls_files(settings)
    if settings.cluster_certs:
        if files and role not in (None, "router"):
            raise ValueError("--tls-* serve the router's public port: a worker's port uses --cluster-certs alone")
        files = read_member_dir(Path(settings.cluster_certs))
        if role is not None and files["identity"].role != role:
            raise ValueError(f"{settings.cluster_certs}/cert.pem is a {files['identity'].role}'s, not a {role}'s")
    if settings.insecure_internal:
        log.warning("--insecure-internal: internal RPCs accept any caller; use this on a trusted network only")
        return Security(token=None, **files)
    token = load_token(settings.cluster_token_file)
    if token is None:
        raise ValueError(
            f"no cluster token: set {TOKEN_ENV}, or {TOKEN_FILE_ENV} / --cluster-token-file to a file holding it "
            "(kvserve up makes one), or pass --insecure-internal on a trusted network"
        )
    security = Security(token=token, **files)
    if role is not None and security.keyring.role not in (MEMBER, role):
        raise ValueError(f"the cluster token is a {security.keyring.role}'s credential, not a {role}'s")
    return security


def load_token(path: str | None = None) -> str | None:
    """The cluster token from ``path`` (else ``$KVSERVE_CLUSTER_TOKEN_FILE``), else ``$KVSERVE_CLUSTER_TOKEN``.

    A token file other users may read or write is refused, as ssh refuses such a private key: whoever reads
    the token is a cluster member, and may write into any worker's KV pool. So is one another user owns
    (root aside): its owner may rewrite it, and so choose the token. The file checked is the file read.
    """
    path = path or os.environ.get(TOKEN_FILE_ENV)
    token = os.environ.get(TOKEN_ENV, "").strip()
    if path:
        with open(path, "rb") as file:
            info = os.fstat(file.fileno())
            if info.st_uid not in (os.getuid(), 0):
                raise ValueError(f"cluster token file {path} belongs to uid {info.st_uid}, not to this user "
                                 f"(uid {os.getuid()}): its owner can rewrite the token; use a file of your own "
                                 "(mode 600) with a new token")  # fmt: skip
            if (mode := info.st_mode & 0o777) & 0o077:
                raise ValueError(f"cluster token file {path} has mode {mode:04o}: other users can read it and "
                                 f"join the cluster; make it private (chmod 600 {path}) and make the token anew")
            token = file.read().decode().strip()
    if path and not token:
        raise ValueError(f"cluster token file {path} is empty")
    return token or None
