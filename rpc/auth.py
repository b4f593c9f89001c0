"""Who may call whom: the cluster token, optional (m)TLS, and signatures on what workers publish.

Trust model:

* The internal services (``Decode``, ``Prefill``, ``KVTransfer``) serve cluster members only. A member
  proves it with the shared cluster token, sent as call metadata (``x-kvserve-token``) and checked by
  one server interceptor (``TokenInterceptor``) in constant time. Health and reflection stay open, and
  so does the router's public ``Inference`` service.
* The token comes from ``KVSERVE_CLUSTER_TOKEN`` or a file (``--cluster-token-file`` /
  ``KVSERVE_CLUSTER_TOKEN_FILE``), never from a command line ``ps`` would show. Without one a service
  refuses to start unless ``--insecure-internal`` says so explicitly (and then it logs a warning).
* Optional TLS on every port with ``--tls-cert/--tls-key``; with ``--tls-ca`` too, peers must present a
  certificate signed by that CA (mutual TLS) and clients verify servers against it.
* Records that workers publish through Redis (worker entries, leases) and the lease a decode worker
  hands a prefill worker carry an HMAC keyed by the token (``sign``/``verify``), so a process that can
  write to Redis but does not hold the token cannot pose as a worker or grant itself KV blocks.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

TOKEN_ENV = "KVSERVE_CLUSTER_TOKEN"
TOKEN_FILE_ENV = "KVSERVE_CLUSTER_TOKEN_FILE"
TOKEN_METADATA = "x-kvserve-token"
CALLER_METADATA = "x-kvserve-worker"  # the calling worker's id (checked against leases, never trusted alone)
INTERNAL_SERVICES = ("kvserve.v1.Decode", "kvserve.v1.Prefill", "kvserve.v1.KVTransfer")
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
    """A process's credentials: the cluster token (``None`` only with ``--insecure-internal``) and TLS files."""

    token: str | None
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    tls_ca: bytes | None = None

    @classmethod
    def insecure(cls) -> Security:
        return cls(token=None)

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    # -- calls ------------------------------------------------------------------------------------------

    def metadata(self, caller: str = "") -> tuple[tuple[str, str], ...]:
        """Call metadata for an internal call made by worker ``caller``."""
        items = []
        if self.token is not None:
            items.append((TOKEN_METADATA, self.token))
        if caller:
            items.append((CALLER_METADATA, caller))
        return tuple(items)

    def aio_channel(self, address: str) -> grpc.aio.Channel:
        if self.tls:
            return grpc.aio.secure_channel(address, self._channel_credentials(), options=GRPC_OPTIONS)
        return grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)

    def channel(self, address: str) -> grpc.Channel:
        if self.tls:
            return grpc.secure_channel(address, self._channel_credentials(), options=GRPC_OPTIONS)
        return grpc.insecure_channel(address, options=GRPC_OPTIONS)

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
        return [] if self.token is None else [TokenInterceptor(self.token)]

    # -- signatures -------------------------------------------------------------------------------------

    def sign(self, *parts: object) -> str:
        """HMAC-SHA256 over ``parts`` keyed by the token ('' when insecure: integrity against mistakes only)."""
        key = (self.token or "").encode()
        message = "\x1f".join(str(p) for p in parts).encode()
        return hmac.new(key, message, hashlib.sha256).hexdigest()

    def verify(self, signature: str, *parts: object) -> bool:
        return hmac.compare_digest(signature.encode(), self.sign(*parts).encode())


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to the internal services that lack the cluster token, with UNAUTHENTICATED."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        service = details.method.lstrip("/").split("/", 1)[0]
        if handler is None or service not in INTERNAL_SERVICES:
            return handler
        given = dict(details.invocation_metadata or ()).get(TOKEN_METADATA, "")
        if isinstance(given, str) and hmac.compare_digest(given.encode(), self._token):
            return handler
        return _denied(handler, f"{details.method} serves cluster members only: send the cluster token "
                                f"({TOKEN_ENV}) as '{TOKEN_METADATA}' metadata")  # fmt: skip


def _denied(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def deny(request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator, as streaming handlers must be

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(deny_stream if handler.response_streaming else deny,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)  # fmt: skip


# -- configuration ------------------------------------------------------------------------------------------


def add_security_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("security")
    group.add_argument("--cluster-token-file", default=None,
                       help=f"file holding the cluster token (default: ${TOKEN_ENV} or ${TOKEN_FILE_ENV})")
    group.add_argument("--insecure-internal", action="store_true",
                       help="serve internal RPCs without the cluster token (logs a warning)")
    group.add_argument("--tls-cert", default=None, help="PEM certificate for this process's ports")
    group.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    group.add_argument("--tls-ca", default=None,
                       help="PEM CA: verify peers with it and require client certificates")


def security_from_args(args: argparse.Namespace) -> Security:
    """The process's ``Security`` from its flags and environment; ``ValueError`` says what is missing."""
    tls = [args.tls_cert, args.tls_key]
    if any(tls) and not all(tls):
        raise ValueError("--tls-cert and --tls-key go together")
    if args.tls_ca and not args.tls_cert:
        raise ValueError("--tls-ca needs --tls-cert and --tls-key (mutual TLS)")
    files = {name: Path(path).read_bytes() for name, path in
             (("tls_cert", args.tls_cert), ("tls_key", args.tls_key), ("tls_ca", args.tls_ca)) if path}  # fmt: skip
    if args.insecure_internal:
        log.warning("--insecure-internal: internal RPCs accept any caller; use this on a trusted network only")
        return Security(token=None, **files)
    token = load_token(args.cluster_token_file)
    if token is None:
        raise ValueError(
            f"no cluster token: set {TOKEN_ENV}, or {TOKEN_FILE_ENV} / --cluster-token-file to a file holding it "
            "(kvserve up makes one), or pass --insecure-internal on a trusted network"
        )
    return Security(token=token, **files)


def load_token(path: str | None = None) -> str | None:
    """The cluster token from ``path`` (else ``$KVSERVE_CLUSTER_TOKEN_FILE``), else ``$KVSERVE_CLUSTER_TOKEN``.

    A token file other users may read or write is refused, as ssh refuses such a private key: whoever reads
    the token is a cluster member, and may write into any worker's KV pool.
    """
    path = path or os.environ.get(TOKEN_FILE_ENV)
    if path and (mode := os.stat(path).st_mode & 0o777) & 0o077:
        raise ValueError(f"cluster token file {path} has mode {mode:04o}: other users can read it and join the "
                         f"cluster; make it private (chmod 600 {path}) and make the token anew")  # fmt: skip
    token = Path(path).read_text().strip() if path else os.environ.get(TOKEN_ENV, "").strip()
    if path and not token:
        raise ValueError(f"cluster token file {path} is empty")
    return token or None
