"""How the load engine talks to a cluster: the router's gRPC ``Inference.Generate`` (``grpc.aio``) or its
OpenAI-compatible ``POST /v1/completions`` streamed over server-sent events (``aiohttp``).

A backend's ``connect(target, sampling, timeout_s)`` is an async context manager over one channel or HTTP
session that yields ``send(request, record)``: it streams one request and fills its ``Record`` (TTFT, the
arrival time and token count of each streamed message, end-to-end time, the server's usage counts, the
status) and never raises for a failed request. Over HTTP a streamed event counts as one token (events carry
text, not token ids; kvserve sends one per decode step, even when its text is held back) and the total comes
from the closing usage event. ``record.client_s`` adds up the time spent in this module's own code: building
the request and handling each message, not waiting for the network or the server.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Protocol

import grpc

from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
from rpc.requests import api_key_metadata, build_request, resolve_api_key

if TYPE_CHECKING:
    from kvserve.bench.loadgen import BenchRequest, Record

Send = Callable[["BenchRequest", "Record"], Awaitable[None]]


class Backend(Protocol):
    def connect(self, target: str, sampling: dict, timeout_s: float): ...


class GrpcBackend:
    """``target`` is the router's HOST:PORT; ``credentials`` for a router that serves TLS; ``api_key`` (default
    ``$KVSERVE_API_KEY``) for one that wants a key."""

    def __init__(self, credentials: grpc.ChannelCredentials | None = None, api_key: str | None = None) -> None:
        self.credentials = credentials
        self.metadata = api_key_metadata(api_key)

    @asynccontextmanager
    async def connect(self, target: str, sampling: dict, timeout_s: float) -> AsyncIterator[Send]:
        if self.credentials is None:
            channel = grpc.aio.insecure_channel(target)
        else:
            channel = grpc.aio.secure_channel(target, self.credentials)
        stub = pb_grpc.InferenceStub(channel)

        async def send(request: BenchRequest, record: Record) -> None:
            began = time.perf_counter()
            proto = build_request(request.prompt, max_tokens=request.max_tokens, **sampling)
            record.num_prompt_tokens = request.num_prompt_tokens
            call = stub.Generate(proto, timeout=timeout_s, metadata=self.metadata)
            record.client_s += time.perf_counter() - began
            try:
                async for msg in call:
                    now = time.perf_counter()
                    if msg.token_ids:
                        _chunk(record, now - began, len(msg.token_ids))
                        record.token_ids.extend(msg.token_ids)
                    if msg.finish_reason:
                        record.num_prompt_tokens = msg.usage.prompt_tokens
                        record.num_cached_tokens = msg.usage.cached_prompt_tokens
                    record.client_s += time.perf_counter() - now
            except grpc.aio.AioRpcError as err:
                record.status, record.detail = err.code().name, err.details() or ""
            record.num_tokens = len(record.token_ids)
            record.e2e_s = time.perf_counter() - began

        async with channel:
            yield send


class OpenAIBackend:
    """``target`` is the router's HTTP API: ``http(s)://HOST:PORT`` or ``HOST:PORT`` (plain HTTP). The model
    name sent is the first that ``/v1/models`` lists. ``api_key`` (default ``$KVSERVE_API_KEY``) goes in an
    ``Authorization: Bearer`` header."""

    def __init__(self, api_key: str | None = None) -> None:
        key = resolve_api_key(api_key)
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    @asynccontextmanager
    async def connect(self, target: str, sampling: dict, timeout_s: float) -> AsyncIterator[Send]:
        import aiohttp

        base = target if "://" in target else f"http://{target}"
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        connector = aiohttp.TCPConnector(limit=0)  # the load engine decides how many are in flight
        async with aiohttp.ClientSession(base, timeout=timeout, connector=connector, headers=self.headers) as session:
            async with session.get("/v1/models") as reply:
                if reply.status == 401:
                    raise SystemExit(f"the router at {base} wants an API key: --api-key or $KVSERVE_API_KEY")
                reply.raise_for_status()
                model = (await reply.json())["data"][0]["id"]

            async def send(request: BenchRequest, record: Record) -> None:
                began = time.perf_counter()
                body = {"model": model, "prompt": request.prompt, "max_tokens": request.max_tokens, "stream": True,
                        "stream_options": {"include_usage": True}, **sampling}  # fmt: skip
                record.num_prompt_tokens = request.num_prompt_tokens
                record.client_s += time.perf_counter() - began
                try:
                    async with session.post("/v1/completions", json=body) as reply:
                        if reply.status != 200:
                            _http_error(record, reply.status, await reply.text())
                        else:
                            await _read_events(reply.content, record, began)
                except (aiohttp.ClientError, TimeoutError) as err:
                    record.status, record.detail = "UNAVAILABLE", f"{type(err).__name__}: {err}"
                record.e2e_s = time.perf_counter() - began

            yield send


async def _read_events(lines: AsyncIterator[bytes], record: Record, began: float) -> None:
    async for line in lines:
        now = time.perf_counter()
        if line.startswith(b"data: "):
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                record.status = event["error"].get("code", "unknown").upper()
                record.detail = event["error"].get("message", "")
            elif _is_token(event):
                _chunk(record, now - began, 1)
            if usage := event.get("usage"):
                record.num_tokens = usage["completion_tokens"]
                record.num_prompt_tokens = usage["prompt_tokens"]
                record.num_cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        record.client_s += time.perf_counter() - now


def _is_token(event: dict) -> bool:
    """Whether a completions event is a token arrival: kvserve sends one event per token message, even when its
    text is held back (empty); an event with a finish reason and no text (llama.cpp's last, which carries the
    usage too) is none."""
    choice = event["choices"][0] if event.get("choices") else None
    return choice is not None and bool(choice.get("text") or choice.get("finish_reason") is None)


def _chunk(record: Record, at_s: float, num_tokens: int) -> None:
    if not record.chunk_s:
        record.ttft_s = at_s
    record.chunk_s.append(at_s)
    record.chunk_tokens.append(num_tokens)


def _http_error(record: Record, status: int, text: str) -> None:
    """An OpenAI error object's ``code`` is the gRPC status name in lower case; anything else: HTTP_<status>."""
    try:
        error = json.loads(text)["error"]
        record.status, record.detail = str(error["code"]).upper(), error.get("message", "")
    except (ValueError, KeyError, TypeError):
        record.status, record.detail = f"HTTP_{status}", text[:200]
