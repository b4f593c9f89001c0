"""The one server interceptor that decides who may call the internal services (``security.keys.CALLERS``):

    kvserve.v1.Decode      <- the router
    kvserve.v1.Prefill     <- decode workers
    kvserve.v1.KVTransfer  <- prefill workers

With cluster certificates (mutual TLS, the default of ``kvserve up``) the caller's role is the one its
certificate names (TLS verified it against the cluster CA before any byte of the call arrived), and a
``x-kvserve-worker`` it sends must be the certificate's name. Without them, the caller sends its role's call
token (``security.keys``) with the role it claims. A call that fails either check ends with UNAUTHENTICATED (no or
a wrong credential) or PERMISSION_DENIED (a member whose role may not call this service) before its handler
runs. Health and reflection stay open, and so does the router's public ``Inference`` service.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from security.identity import peer_identity
from security.keys import CALLERS, MEMBER

if TYPE_CHECKING:
    from security.auth import Security

TOKEN_METADATA = "x-kvserve-token"
ROLE_METADATA = "x-kvserve-role"  # the role whose call token ``x-kvserve-token`` is
CALLER_METADATA = "x-kvserve-worker"  # the calling worker's id (checked against leases, never trusted alone)

Refusal = tuple[grpc.StatusCode, str] | None


class CallerInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, security: Security) -> None:
        self._security = security

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        service = details.method.lstrip("/").split("/", 1)[0]
        if handler is None or service not in CALLERS:
            return handler
        metadata = dict(details.invocation_metadata or ())
        if self._security.identity is not None:  # who calls is known only inside the call: check it there
            return _checked(handler, lambda context: _certificate_refusal(context, service, metadata))
        refusal = self._security.keyring.call_refusal(service, str(metadata.get(ROLE_METADATA, MEMBER)),
                                                      str(metadata.get(TOKEN_METADATA, "")))  # fmt: skip
        if refusal == "unauthenticated":
            return _checked(handler, lambda _: (grpc.StatusCode.UNAUTHENTICATED, f"{details.method} serves cluster "
                                                "members only: send your role's call token as "
                                                f"'{TOKEN_METADATA}' metadata (security.keys)"))  # fmt: skip
        if refusal:
            return _checked(handler, lambda _: (grpc.StatusCode.PERMISSION_DENIED, refusal))
        return handler


def _certificate_refusal(context: grpc.aio.ServicerContext, service: str, metadata: dict) -> Refusal:
    caller = peer_identity(context)
    if caller is None:
        return grpc.StatusCode.UNAUTHENTICATED, f"{service} serves cluster members only: present a certificate " \
                                                "of the cluster CA that names your role (kvserve certs)"
    if caller.role not in CALLERS[service]:
        return grpc.StatusCode.PERMISSION_DENIED, f"a {caller.role} may not call {service} " \
                                                  f"(only {', '.join(CALLERS[service])}); you are {caller}"
    claimed = metadata.get(CALLER_METADATA, caller.name)
    if claimed != caller.name:
        return grpc.StatusCode.PERMISSION_DENIED, f"your certificate names {caller.name!r}, not {claimed!r}"
    return None


def _checked(handler: grpc.RpcMethodHandler, refusal: Callable[[grpc.aio.ServicerContext], Refusal]
             ) -> grpc.RpcMethodHandler:  # fmt: skip
    """``handler``, which first ends the call with ``refusal(context)`` when that is not None."""
    streaming_in, streaming_out = handler.request_streaming, handler.response_streaming
    inner = {(False, False): handler.unary_unary, (False, True): handler.unary_stream,
             (True, False): handler.stream_unary, (True, True): handler.stream_stream}[(streaming_in, streaming_out)]

    async def unary_out(request_or_iterator, context: grpc.aio.ServicerContext):
        if (problem := refusal(context)) is not None:
            await context.abort(*problem)
        return await inner(request_or_iterator, context)

    async def stream_out(request_or_iterator, context: grpc.aio.ServicerContext):
        if (problem := refusal(context)) is not None:
            await context.abort(*problem)
        async for response in inner(request_or_iterator, context):
            yield response

    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}[(streaming_in, streaming_out)]  # fmt: skip
    return make(stream_out if streaming_out else unary_out, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)  # fmt: skip
