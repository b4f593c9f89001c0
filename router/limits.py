"""The router's front door: what every public request passes before ``Router.generate`` sees it, on both doors.

* **API key** (``--api-key``, ``KVSERVE_API_KEY``, or the keys of a tenants file, ``--api-keys-file``:
  ``router.tenants``; none by default). As with vLLM's ``--api-key``, a call must then carry ``Authorization:
  Bearer <key>`` (an HTTP header; ``authorization`` metadata on gRPC), whose hash names its tenant, else it
  gets 401 with an OpenAI error object, or UNAUTHENTICATED. HTTP ``/health`` and
  gRPC health checking and reflection stay open (vLLM leaves ``/health`` open too): load balancers and
  orchestrators probe them without a key. ``/metrics`` on the API port needs the key; on ``--metrics-port``
  it does not (keep that port private).
* **Request size** (``--max-request-bytes``, default 4 MiB). An HTTP body past it gets 413 before it is
  parsed: a declared ``Content-Length`` is refused before one byte of the body is read, a chunked body as
  soon as the bytes read pass the limit; the connection is then closed, so the rest is never read. The
  public gRPC port refuses larger messages with RESOURCE_EXHAUSTED (gRPC's own receive limit, which the
  router sets to the same value). Valid requests are far smaller: prompts are at most
  ``rpc.validation.MAX_PROMPT_BYTES``.
* **Requests in flight** (``--max-concurrent-requests``, default 512, 0: no limit): generation calls of both
  doors together, from arrival to the end of the stream. Past it: 429 / RESOURCE_EXHAUSTED, saying so.
* **A tenant's bounds** (its requests in flight, its tokens per minute: ``router.tenants``): past one, 429 with
  ``Retry-After`` / RESOURCE_EXHAUSTED with ``retry-after`` trailing metadata, naming the bound. The tenant of
  an admitted request is ``ADMITTED`` (a context variable) for ``Router.generate``, which queues it fairly
  (``router.fair_queue``) and records the tokens it used.

Every refusal here is counted in ``kvserve_router_refused_total{reason}``. A refusal sent before the body
was read closes the connection. The ``FrontDoor`` lives on the router's event loop (no locks).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
from router import openai_protocol as api
from router.tenants import Refused, Tenant, Tenants
from rpc import metrics
from rpc.requests import API_KEY_ENV, resolve_api_key

if TYPE_CHECKING:
    from router.settings import FrontDoorSettings

DEFAULT_MAX_REQUEST_BYTES = 4 << 20
DEFAULT_MAX_CONCURRENT_REQUESTS = 512
_OPEN_PATHS = {"/health"}
_GENERATE_PATHS = {"/v1/completions", "/v1/chat/completions"}

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class Admitted:
    """A request the front door let in: its tenant, and the tokens it used (from its usage, when it ends)."""

    tenant: Tenant
    prompt_tokens: int = 0
    completion_tokens: int = 0


ADMITTED: contextvars.ContextVar[Admitted | None] = contextvars.ContextVar("admitted", default=None)


class FrontDoor:
    """The API keys and tenants, the request size limit and the count of requests in flight, shared by both
    doors."""

    def __init__(self, api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS,
                 tenants: Tenants | None = None) -> None:  # fmt: skip
        if max_request_bytes < 1 or max_concurrent_requests < 0:
            raise ValueError(f"--max-request-bytes must be at least 1 (got {max_request_bytes}) and "
                             f"--max-concurrent-requests at least 0 (got {max_concurrent_requests})")  # fmt: skip
        self.tenants = tenants or Tenants(api_key=api_key)  # (keys only as hashes: never in a repr or a log)
        self.max_request_bytes = max_request_bytes
        self.max_concurrent_requests = max_concurrent_requests
        self.num_active = 0

    def tenant(self, authorization: str | bytes | None) -> Tenant | None:
        """The tenant an ``Authorization`` value (``Bearer <key>``) names; None: the call is refused (401)."""
        return self.tenants.identify(authorization)

    def admit(self, tenant: Tenant) -> Admitted:
        """``tenant``'s call, counted in flight: ``Refused`` over one of its bounds."""
        self.tenants.enter(tenant)
        return Admitted(tenant)

    def done(self, admitted: Admitted, outcome: str) -> None:
        """An admitted request ended (``outcome``: ok, error or cancelled): its tenant's use and count."""
        self.tenants.leave(admitted.tenant, admitted.prompt_tokens, admitted.completion_tokens)
        metrics.TENANT_REQUESTS.labels(admitted.tenant.name, outcome).inc()

    def try_enter(self) -> bool:
        """Count one more request in flight, unless the limit is reached (then False, nothing counted)."""
        if self.max_concurrent_requests and self.num_active >= self.max_concurrent_requests:
            metrics.ROUTER_REFUSED.labels("busy").inc()
            return False
        self.num_active += 1
        return True

    def leave(self) -> None:
        self.num_active -= 1

    def busy_message(self) -> str:
        return (f"the router is serving its limit of {self.max_concurrent_requests} concurrent requests "
                "(--max-concurrent-requests); retry in a moment, or raise the limit")  # fmt: skip

    def too_large_message(self, num_bytes: int | None) -> str:
        size = "is larger" if num_bytes is None else f"has {num_bytes} bytes, more"
        return (f"the request body {size} than the router's limit of {self.max_request_bytes} bytes "
                "(--max-request-bytes); send a shorter prompt")  # fmt: skip


UNAUTHORIZED = f"missing or wrong API key: send 'Authorization: Bearer <key>' (the router's ${API_KEY_ENV})"


class PublicInference(pb_grpc.InferenceServicer):
    """The public gRPC ``Inference`` service: ``router``'s ``Generate`` behind the front door."""

    def __init__(self, router: pb_grpc.InferenceServicer, door: FrontDoor) -> None:
        self.router, self.door = router, door

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator:
        tenant = self.door.tenant(dict(context.invocation_metadata() or ()).get("authorization"))
        if tenant is None:
            metrics.ROUTER_REFUSED.labels("unauthenticated").inc()
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHORIZED)
        if not self.door.try_enter():
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self.door.busy_message())
        try:
            try:
                admitted = self.door.admit(tenant)
            except Refused as err:
                context.set_trailing_metadata((("retry-after", str(err.retry_after_s)),))
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
            ADMITTED.set(admitted)
            outcome = "error"
            try:
                async with aclosing(self.router.Generate(request, context)) as stream:
                    async for msg in stream:
                        yield msg
                outcome = "ok"
            except asyncio.CancelledError:
                outcome = "cancelled"
                raise
            finally:
                self.door.done(admitted, outcome)
        finally:
            self.door.leave()


class HttpFrontDoor:
    """ASGI middleware for the HTTP API: the key (401), the declared size (413), the concurrency limit (429)
    on the generation endpoints, then the body, counted as it is read (413 past the limit), and the app."""

    def __init__(self, app: Callable, door: FrontDoor) -> None:
        self.app, self.door = app, door

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        tenant = self.door.tenant(headers.get(b"authorization"))
        if scope["path"] not in _OPEN_PATHS and tenant is None:
            metrics.ROUTER_REFUSED.labels("unauthenticated").inc()
            await _refuse(send, grpc.StatusCode.UNAUTHENTICATED, UNAUTHORIZED, [(b"www-authenticate", b"Bearer")])
            return
        declared = headers.get(b"content-length", b"").strip()
        if declared.isdigit() and int(declared) > self.door.max_request_bytes:
            await _too_large(send, self.door.too_large_message(int(declared)))
            return
        generating = scope["path"] in _GENERATE_PATHS
        if generating and not self.door.try_enter():
            await _refuse(send, grpc.StatusCode.RESOURCE_EXHAUSTED, self.door.busy_message())
            return
        admitted, seen = None, {}
        try:
            if generating:
                try:
                    admitted = self.door.admit(tenant)
                except Refused as err:
                    await _refuse(send, grpc.StatusCode.RESOURCE_EXHAUSTED, str(err),
                                  [(b"retry-after", str(err.retry_after_s).encode())])  # fmt: skip
                    return
                ADMITTED.set(admitted)
            body = await _read_body(receive, self.door.max_request_bytes)
            if body is _TOO_LARGE:
                await _too_large(send, self.door.too_large_message(None))
            elif body is not None:
                await self.app(scope, _replay(body, receive), _watch_status(send, seen))
        finally:
            if admitted is not None:
                self.door.done(admitted, "ok" if 200 <= seen.get("status", 0) < 300 else "error")
            if generating:
                self.door.leave()


_TOO_LARGE = object()


def _watch_status(send: Send, seen: dict[str, int]) -> Send:
    """``send``, noting the response's status in ``seen``."""

    async def watched(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            seen["status"] = message["status"]
        await send(message)

    return watched


async def _read_body(receive: Receive, limit: int) -> bytes | object | None:
    """The whole body; ``_TOO_LARGE`` as soon as more than ``limit`` bytes came (the rest is never read);
    None when the client left."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return _TOO_LARGE
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the app the body read already, then what the server says (a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> dict[str, Any]:
        return pending.pop() if pending else await receive()

    return replayed


async def _too_large(send: Send, message: str) -> None:
    metrics.ROUTER_REFUSED.labels("too_large").inc()
    error = api.error_body(message, "invalid_request_error", grpc.StatusCode.RESOURCE_EXHAUSTED.name.lower())
    await _reply(send, 413, error)


async def _refuse(send: Send, code: grpc.StatusCode, message: str,
                  headers: list[tuple[bytes, bytes]] | None = None) -> None:  # fmt: skip
    status, error = api.error(code, message)
    await _reply(send, status, error, headers)


async def _reply(send: Send, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]] | None = None
                 ) -> None:  # fmt: skip
    """Answer without reading the request's body, and close the connection so that it is never read."""
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            (b"connection", b"close"), *(headers or [])]})  # fmt: skip
    await send({"type": "http.response.body", "body": data})


# -- configuration ------------------------------------------------------------------------------------------


def front_door_from_settings(settings: FrontDoorSettings) -> FrontDoor:
    """The ``FrontDoor`` of the router's settings (``--api-key`` or ``$KVSERVE_API_KEY``: blank means none;
    ``--api-keys-file``: ``ValueError`` naming what to fix in it)."""
    tenants = Tenants(settings.api_keys_file, resolve_api_key(settings.api_key))
    return FrontDoor(None, settings.max_request_bytes, settings.max_concurrent_requests, tenants)
