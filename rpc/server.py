"""Server set-up every kvserve process shares: a ``grpc.aio`` server with the token interceptor, TLS when
configured, health checking and reflection; and the wait for a peer to become healthy.

A process that a launcher started gets a secret in ``KVSERVE_INSTANCE_ID``, new at every start. Its health
service then proves who answers: a health check that carries a random challenge gets the challenge's
HMAC under that secret back in the trailing metadata. ``wait_healthy`` with the secret accepts SERVING only
with that proof, so any other process that listens on the child's port (one that answers SERVING to every
check included) never passes for the child.

Every service is served by ``grpc.aio``: a streaming ``Generate`` holds a coroutine, not a thread, so
thousands of open streams never starve ``PushKV`` or a new call (a thread pool of 32 did).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import NoReturn

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos.kvserve.v1 import kvserve_pb2 as pb
from security.auth import GRPC_OPTIONS, Security
from security.identity import Identity

SERVICES = ("Inference", "Decode", "Prefill", "KVTransfer")
INSTANCE_ENV = "KVSERVE_INSTANCE_ID"
_CHALLENGE_KEY = "kvserve-health-challenge"
_PROOF_KEY = "kvserve-health-proof"


def new_server(security: Security, max_receive_bytes: int | None = None) -> grpc.aio.Server:
    """A ``grpc.aio`` server (create it on the event loop that will run it); ``max_receive_bytes`` sets the
    largest request message it accepts (larger ones end with RESOURCE_EXHAUSTED before Python parses them)."""
    # no SO_REUSEPORT: a second process on a taken port must fail, not silently split the traffic. Keepalive:
    # a peer that vanished without closing its connection (a dead host, a dropped network) has its calls
    # cancelled, and their KV blocks freed, within 30 + 10 s instead of holding them until TCP gives up.
    options = [*GRPC_OPTIONS, ("grpc.so_reuseport", 0), ("grpc.keepalive_time_ms", 30_000),
               ("grpc.keepalive_timeout_ms", 10_000)]  # fmt: skip
    if max_receive_bytes is not None:
        options = [o for o in options if o[0] != "grpc.max_receive_message_length"]
        options.append(("grpc.max_receive_message_length", max_receive_bytes))
    return grpc.aio.server(interceptors=security.interceptors(), options=options)


def add_service(server: grpc.aio.Server, name: str, servicer: object) -> str:
    """Register the ``grpc.aio`` servicer ``servicer`` for ``kvserve.v1.{name}``; returns the full service name.

    The handlers are built from the service's descriptor, like the generated ``add_*Servicer_to_server``, with
    one difference: bytes that do not parse as the method's request message end the call with
    INVALID_ARGUMENT (the generated deserializer raises into gRPC, which answers INTERNAL). Streaming
    responses come from async generators; streamed requests reach the servicer through its request
    iterator, which aborts the call at the first bad message.
    """
    if name not in SERVICES:
        raise ValueError(f"unknown service {name!r}; expected one of {SERVICES}")
    service = pb.DESCRIPTOR.services_by_name[name]
    handlers = {method.name: _handler(method, getattr(servicer, method.name)) for method in service.methods}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
    return service.full_name


class _Undecodable:
    """What the deserializer hands the handler in place of a request it could not parse."""

    def __init__(self, error: DecodeError) -> None:
        self.error = error


def _handler(method: MethodDescriptor, behaviour: Callable) -> grpc.RpcMethodHandler:
    request_class = message_factory.GetMessageClass(method.input_type)
    response_class = message_factory.GetMessageClass(method.output_type)
    problem = f"request is not a valid {method.input_type.full_name} message"

    def parse(data: bytes) -> object:
        try:
            return request_class.FromString(data)
        except DecodeError as err:
            return _Undecodable(err)

    async def checked(request, context: grpc.aio.ServicerContext):
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{problem}: {request.error}")
        return request

    async def checked_stream(requests: AsyncIterator, context: grpc.aio.ServicerContext) -> AsyncIterator:
        async for request in requests:
            yield await checked(request, context)

    async def unary_in(request, context: grpc.aio.ServicerContext):
        return await behaviour(await checked(request, context), context)

    async def unary_in_stream_out(request, context: grpc.aio.ServicerContext):
        async for response in behaviour(await checked(request, context), context):
            yield response

    async def stream_in(requests, context: grpc.aio.ServicerContext):
        return await behaviour(checked_stream(requests, context), context)

    async def stream_in_stream_out(requests, context: grpc.aio.ServicerContext):
        async for response in behaviour(checked_stream(requests, context), context):
            yield response

    make, handle = {
        (False, False): (grpc.unary_unary_rpc_method_handler, unary_in),
        (False, True): (grpc.unary_stream_rpc_method_handler, unary_in_stream_out),
        (True, False): (grpc.stream_unary_rpc_method_handler, stream_in),
        (True, True): (grpc.stream_stream_rpc_method_handler, stream_in_stream_out),
    }[(method.client_streaming, method.server_streaming)]
    return make(handle, request_deserializer=parse, response_serializer=response_class.SerializeToString)


async def start_server(
    server: grpc.aio.Server, service_names: list[str], address: str, security: Security
) -> tuple[int, health.aio.HealthServicer]:
    """Add health checking and reflection, bind ``address`` and start; returns (port, health servicer)."""
    health_servicer = _ProvingHealthServicer(os.environ.get(INSTANCE_ENV) or None)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    port = security.bind(server, address)
    await server.start()
    for name in ["", *service_names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return port, health_servicer


async def set_not_serving(health_servicer: health.aio.HealthServicer, service_names: list[str]) -> None:
    """Tell health checkers (routers, the launcher) to stop sending new work: the process is draining."""
    for name in ["", *service_names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


class _ProvingHealthServicer(health.aio.HealthServicer):
    """The standard health service; with an instance id, a check that carries a challenge also gets the proof
    that this process knows the id (see the module docstring)."""

    def __init__(self, instance_id: str | None) -> None:
        super().__init__()
        self._instance_id = instance_id

    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext):
        challenge = dict(context.invocation_metadata() or ()).get(_CHALLENGE_KEY)
        if self._instance_id is not None and isinstance(challenge, str):
            context.set_trailing_metadata(((_PROOF_KEY, _proof(self._instance_id, challenge)),))
        return await super().Check(request, context)


def _proof(instance_id: str, challenge: str) -> str:
    return hmac.new(instance_id.encode(), challenge.encode(), hashlib.sha256).hexdigest()


def _proven(call: grpc.Call, instance_id: str, challenge: str) -> bool:
    proof = str(dict(call.trailing_metadata() or ()).get(_PROOF_KEY, ""))
    return hmac.compare_digest(proof.encode(), _proof(instance_id, challenge).encode())


def wait_healthy(address: str, timeout_s: float, security: Security | None = None,
                 instance_id: str | None = None, peer: Identity | None = None) -> bool:  # fmt: skip
    """True once ``address`` answers SERVING to a health check within ``timeout_s``; with ``instance_id``, only
    when the answer proves it comes from the process started with that id (``INSTANCE_ENV``); with ``peer``
    and cluster certificates, only from a server whose certificate names ``peer``."""
    deadline = time.monotonic() + timeout_s
    with (security or Security.insecure()).channel(address, peer) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            challenge = secrets.token_hex(16)
            try:
                reply, call = stub.Check.with_call(health_pb2.HealthCheckRequest(), timeout=1.0,
                                                   metadata=((_CHALLENGE_KEY, challenge),))  # fmt: skip
                serving = reply.status == health_pb2.HealthCheckResponse.SERVING
                if serving and (instance_id is None or _proven(call, instance_id, challenge)):
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    return False


def exit_stopped_process() -> NoReturn:
    """Exit a server process (``python -m router|prefill_service|decode_service``) whose ``main`` returned, so
    has stopped serving and closed what it opened (its pool file, tiers, Redis entry, transports): flush the
    logs and skip the interpreter's teardown, whose garbage collection of torch's and gRPC's objects takes
    ~1.5 s of a CPU after the last log line, time a launcher's stop and a supervisor's restart wait out."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
