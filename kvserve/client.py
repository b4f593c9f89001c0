"""The Python client: ``Client("host:port").generate(...)``, ``.stream(...)``, and ``AsyncClient`` for asyncio.

A prompt is text, a list of token ids, or chat messages (a list of OpenAI's message dicts: ``{"role",
"content"}``, an assistant's ``tool_calls``, a tool's ``tool_call_id``), rendered with the model's chat template,
which also lists ``tools=[...]`` (OpenAI's function tools; the answer is the model's text, calls unparsed).
Options are ``build_request``'s keywords, structured outputs
included: ``structured_outputs={"json": schema}`` (or ``regex``, ``choice``, ``grammar``, ``json_object``) or
OpenAI's ``response_format``. Errors arrive as ``grpc.RpcError`` with the server's
status code and message. A router started with an API key wants it with every call: ``api_key=``, by
default ``$KVSERVE_API_KEY``. ``traceparent="00-<trace id>-<span id>-01"`` (W3C) makes the request's trace,
where the cluster traces (``--otlp-traces-endpoint``), a part of the caller's.

``n=k`` samples k choices of the prompt (computed once): ``stream`` yields their chunks interleaved, each with
its ``index``, and ``generate`` returns a list of k ``Result``s, by index (with ``n`` unset or 1, one
``Result``, as ever). The request's usage (the prompt once, every choice's completion tokens), timings and
workers come on the stream's last chunk; with ``n=k`` every ``Result`` carries them.

``address`` may name several routers (a list, ``"a:50051,b:50051"``, or a DNS name with several records):
each call starts on the next, and one that fails is retried, or its stream resumed, through another
(``kvserve.failover``; ``failover=False`` turns that off).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from kvserve.failover import Call, Routers, router_addresses
from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
from rpc.requests import Prompt, api_key_metadata, build_request

__all__ = ["AsyncClient", "Chunk", "Client", "Logprob", "Prompt", "Result", "build_request"]


@dataclass
class Logprob:
    """A token's log-probability under the model's raw distribution, and the ``top`` most likely tokens at its
    position as (token id, log-probability), most likely first (``logprobs=k`` asks for k)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Chunk:
    """One streamed piece: new token ids and their text; the last one has ``finish_reason``."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    usage: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    transfer_backend: str = ""
    decode_worker: str = ""
    prefill_worker: str = ""
    logprobs: list[Logprob] | None = None  # of token_ids, when asked for (``logprobs=k``)
    prompt_logprobs: list[Logprob] | None = None  # first chunk, of prompt tokens 1, 2, ... (``prompt_logprobs=k``)
    prompt_token_ids: list[int] | None = None  # first chunk, with prompt_logprobs
    index: int = 0  # the choice it belongs to (``n=k``: 0 .. k-1)


@dataclass
class Result:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: dict[str, int]
    timings: dict[str, float]
    transfer_backend: str = ""
    decode_worker: str = ""
    prefill_worker: str = ""
    logprobs: list[Logprob] | None = None
    prompt_logprobs: list[Logprob] | None = None
    prompt_token_ids: list[int] | None = None


def _logprobs(entries) -> list[Logprob]:
    return [Logprob(e.token_id, e.logprob, [(t.token_id, t.logprob) for t in e.top]) for e in entries]


def _chunk(msg: pb.GenerateResponse) -> Chunk:
    chunk = Chunk(list(msg.token_ids), msg.text, index=msg.index)
    if msg.logprobs:
        chunk.logprobs = _logprobs(msg.logprobs)
    if msg.prompt_token_ids:
        chunk.prompt_logprobs, chunk.prompt_token_ids = _logprobs(msg.prompt_logprobs), list(msg.prompt_token_ids)
    chunk.finish_reason = msg.finish_reason or None
    if msg.HasField("usage"):  # the stream's last message
        chunk.usage = {"prompt_tokens": msg.usage.prompt_tokens, "completion_tokens": msg.usage.completion_tokens,
                       "cached_prompt_tokens": msg.usage.cached_prompt_tokens}  # fmt: skip
        chunk.timings = {"ttft_ms": msg.timings.ttft_ms, "total_ms": msg.timings.total_ms,
                         "prefill_ms": msg.timings.prefill_ms, "transfer_ms": msg.timings.transfer_ms}  # fmt: skip
        chunk.transfer_backend = msg.transfer_backend
        chunk.decode_worker = msg.decode_worker
        chunk.prefill_worker = msg.prefill_worker
    return chunk


def _result(chunks: list[Chunk]) -> Result:
    last = chunks[-1] if chunks else Chunk([], "")
    return Result(
        text="".join(c.text for c in chunks),
        token_ids=[t for c in chunks for t in c.token_ids],
        finish_reason=last.finish_reason,
        usage=last.usage,
        timings=last.timings,
        transfer_backend=last.transfer_backend,
        decode_worker=last.decode_worker,
        prefill_worker=last.prefill_worker,
        logprobs=[lp for c in chunks for lp in c.logprobs or ()] if any(c.logprobs for c in chunks) else None,
        prompt_logprobs=next((c.prompt_logprobs for c in chunks if c.prompt_token_ids), None),
        prompt_token_ids=next((c.prompt_token_ids for c in chunks if c.prompt_token_ids), None),
    )


def _results(chunks: list[Chunk], n: int | None) -> Result | list[Result]:
    """One ``Result`` (``n`` unset or 1), else one per choice by index, each with the request's usage."""
    if not n or n == 1:
        return _result(chunks)
    results = [_result([c for c in chunks if c.index == i]) for i in range(n)]
    final = next((c for c in reversed(chunks) if c.usage), None)
    for result in results if final is not None else ():
        result.usage, result.timings = final.usage, final.timings
        result.transfer_backend, result.decode_worker, result.prefill_worker = (
            final.transfer_backend, final.decode_worker, final.prefill_worker)  # fmt: skip
    return results


def _metadata(api_key: tuple[tuple[str, str], ...], traceparent: str | None) -> tuple[tuple[str, str], ...]:
    """A call's metadata: the API key, and the caller's W3C ``traceparent`` (its trace continues in ours)."""
    return api_key + ((("traceparent", traceparent),) if traceparent else ())


def _channels(grpc_module, address: str | Sequence[str], credentials: grpc.ChannelCredentials | None) -> list:
    """One channel per router (``grpc`` or ``grpc.aio``)."""
    addresses, tls_name = router_addresses(address)
    if credentials is None:
        return [grpc_module.insecure_channel(a) for a in addresses]
    options = [("grpc.ssl_target_name_override", tls_name)] if tls_name else []
    return [grpc_module.secure_channel(a, credentials, options=options) for a in addresses]


class Client:
    """A client of the routers' public port (one or several: ``kvserve.failover``); ``credentials``
    (``grpc.ssl_channel_credentials``) when they serve TLS; ``api_key`` (default ``$KVSERVE_API_KEY``) when
    they want one."""

    def __init__(
        self,
        address: str | Sequence[str] = "127.0.0.1:50051",
        timeout_s: float | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        api_key: str | None = None,
        failover: bool = True,
    ) -> None:
        self._channels = _channels(grpc, address, credentials)
        self._stubs = [pb_grpc.InferenceStub(channel) for channel in self._channels]
        self._routers = Routers(len(self._channels), failover)
        self._metadata = api_key_metadata(api_key)
        self.timeout_s = timeout_s

    def stream(self, prompt: Prompt, traceparent: str | None = None, **options) -> Iterator[Chunk]:
        call = Call(build_request(prompt, **options), self._routers)
        metadata = _metadata(self._metadata, traceparent)
        for index, request, last in call.tries():
            rpc = self._stubs[index].Generate(request, timeout=self.timeout_s, metadata=metadata)
            try:
                for msg in rpc:
                    call.received(msg)
                    yield _chunk(msg)
                return
            except grpc.RpcError as err:
                call.failed(index, err, last)
            finally:
                rpc.cancel()  # a no-op once it ended; the caller stopped reading otherwise

    def generate(self, prompt: Prompt, **options) -> Result | list[Result]:
        """The whole answer: a ``Result``, or with ``n=k`` (k > 1) a list of k, by choice."""
        return _results(list(self.stream(prompt, **options)), options.get("n"))

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """``Client`` for asyncio."""

    def __init__(
        self,
        address: str | Sequence[str] = "127.0.0.1:50051",
        timeout_s: float | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        api_key: str | None = None,
        failover: bool = True,
    ) -> None:
        self._channels = _channels(grpc.aio, address, credentials)
        self._stubs = [pb_grpc.InferenceStub(channel) for channel in self._channels]
        self._routers = Routers(len(self._channels), failover)
        self._metadata = api_key_metadata(api_key)
        self.timeout_s = timeout_s

    async def stream(self, prompt: Prompt, traceparent: str | None = None, **options) -> AsyncIterator[Chunk]:
        call = Call(build_request(prompt, **options), self._routers)
        metadata = _metadata(self._metadata, traceparent)
        for index, request, last in call.tries():
            rpc = self._stubs[index].Generate(request, timeout=self.timeout_s, metadata=metadata)
            try:
                async for msg in rpc:
                    call.received(msg)
                    yield _chunk(msg)
                return
            except grpc.RpcError as err:
                call.failed(index, err, last)
            finally:
                rpc.cancel()

    async def generate(self, prompt: Prompt, **options) -> Result | list[Result]:
        return _results([c async for c in self.stream(prompt, **options)], options.get("n"))

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
