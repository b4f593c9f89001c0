"""The router's OpenAI-compatible HTTP front door (FastAPI on uvicorn, on the router's own event loop).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` over server-sent events, ending
with ``data: [DONE]``; ``stream_options.include_usage`` adds a closing usage event), ``GET /v1/models`` (each
served name, with ``root`` and ``max_model_len``), vLLM's ``POST /tokenize`` and ``POST /detokenize`` (on the
router's tokenizer thread), ``GET /health`` (503 while no decode worker answers), ``GET /metrics`` (Prometheus,
``rpc.metrics``; not here when the router serves it on its own ``--metrics-port``). Every request first passes
the front door (``router.limits``): the API key, the body-size limit and the concurrency limit. A body whose
``model`` is none of the served names gets 404 ``model_not_found``; one without ``model`` gets the first.

A request's life here: the body is parsed (``router.openai_protocol``) into the same ``pb.GenerateRequest``
the gRPC door takes and handed to ``Router.generate`` in this process: validation, routing and the decode
call are the gRPC path's, with no second hop. Errors before the first token become OpenAI error objects with
the matching HTTP status (400 bad input, 429 the workers are full, 503 no worker); a stream that fails later
ends with an ``error`` event. A client that disconnects, whether waiting for the first token, reading a
stream or waiting for a whole answer, closes the router's stream, which cancels the decode call and frees
its blocks.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Sequence
from contextlib import suppress
from typing import Any, TypeVar

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engine.sampling_params import check_token_ids
from protos.kvserve.v1 import kvserve_pb2 as pb
from router import openai_protocol as api
from router.limits import FrontDoor, HttpFrontDoor
from router.openai_fields import FieldError
from router.openai_logprobs import TokenText
from router.openai_response import Choices, Tools, collect, completion, events, merged
from router.server import RouteError, Router
from router.validation_queue import ValidationBusy
from rpc.chat import chat_messages, chat_texts, encode_chat, tool_call_format
from rpc.streams import cancel_when_stalled

_T = TypeVar("_T")
_CLIENT_GONE = 499  # nginx's "client closed request": nobody reads it, but logs show what happened


class _ClientGone(Exception):
    pass


def create_app(router: Router, model_names: str | Sequence[str], door: FrontDoor | None = None,
               serve_metrics: bool = True, root: str | None = None,
               tool_call_parser: str = "auto") -> FastAPI:  # fmt: skip
    """The HTTP API over ``router`` behind ``door`` (default: no key, default limits); ``model_names`` are what
    ``/v1/models`` lists and requests may name (answers carry the name asked for, else the first); ``root`` is
    the model's path (default: the first name); ``serve_metrics`` false leaves ``/metrics`` to another port;
    ``tool_call_parser``: the format of the model's tool calls (``router.openai_tools``; auto: the chat
    template's)."""
    names = [model_names] if isinstance(model_names, str) else list(model_names)
    template = str(router.tokenizer.hf.chat_template or "") if router.tokenizer is not None else ""
    call_format = tool_call_format(template) if tool_call_parser == "auto" else tool_call_parser
    served = _Served(names, root or names[0], router.max_context, call_format)
    app = FastAPI(title="kvserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(HttpFrontDoor, door=door or FrontDoor())

    @app.exception_handler(RequestValidationError)
    async def bad_body(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _error(grpc.StatusCode.INVALID_ARGUMENT, f"{param or 'body'}: {first.get('msg', 'invalid')}", param)

    @app.get("/health")
    async def health() -> Response:
        if await router.ready():
            return JSONResponse({"status": "ok"})
        return _error(grpc.StatusCode.UNAVAILABLE, "no decode worker is available")

    if serve_metrics:

        @app.get("/metrics")
        async def prometheus_metrics() -> Response:
            return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [served.card(name) for name in served.names]}

    @app.post("/v1/completions")
    async def completions(body: api.CompletionRequest, request: Request) -> Response:
        return served.refuse(body.model) or await _serve(router, served, body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: api.ChatCompletionRequest, request: Request) -> Response:
        return served.refuse(body.model) or await _serve(router, served, body, request, chat=True)

    @app.post("/tokenize")
    async def tokenize(body: api.TokenizeRequest) -> Response:
        return served.refuse(body.model) or await _tokenize(router, body)

    @app.post("/detokenize")
    async def detokenize(body: api.DetokenizeRequest) -> Response:
        return served.refuse(body.model) or await _detokenize(router, body)

    return app


class _Served:
    """The names the API serves its one model under, what ``/v1/models`` says of it, and how it writes tool
    calls."""

    def __init__(self, names: list[str], root: str, max_model_len: int, tool_call_format: str) -> None:
        self.names, self.root, self.max_model_len = names, root, max_model_len
        self.tool_call_format = tool_call_format

    def card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "kvserve", "root": self.root,
                "parent": None, "max_model_len": self.max_model_len}  # fmt: skip

    def name(self, asked: str | None) -> str:
        return asked or self.names[0]

    def refuse(self, asked: str | None) -> JSONResponse | None:
        """404 ``model_not_found`` (as OpenAI answers it) for a name not served; None for a served one or none."""
        if not asked or asked in self.names:
            return None
        shown = asked if len(asked) <= 64 else asked[:61] + "..."
        body = api.error_body(f"The model {shown!r} does not exist; this server serves {self.names}",
                              "invalid_request_error", "model_not_found", "model")  # fmt: skip
        return JSONResponse(body, status_code=404)


async def _serve(router: Router, served: _Served, body: api.CompletionRequest | api.ChatCompletionRequest,
                 request: Request, chat: bool) -> Response:  # fmt: skip
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    model = served.name(body.model)
    try:
        body.check_fields()
        protos = [body.to_proto(request_id)] if chat else body.to_protos(request_id)
        tools = Tools(body.tool_plan, served.tool_call_format) if chat and body.tool_plan.mode else None
    except ValueError as err:
        return _error(grpc.StatusCode.INVALID_ARGUMENT, str(err), getattr(err, "param", None))
    try:
        echoes = [await _echo(router, body, proto, chat) for proto in protos]
    except ValueError as err:
        return _error(grpc.StatusCode.INVALID_ARGUMENT, str(err), "prompt")
    logprobs = protos[0].sampling.HasField("logprobs")
    choices = Choices(chat, TokenText(router.tokenizer), logprobs, echoes, body.n or 1, tools)
    stream = merged([router.generate(proto, trace_carrier=request.headers) for proto in protos])
    try:
        if not body.stream:
            await _unless_gone(request, collect(stream, choices))
            await stream.aclose()
            return JSONResponse(completion(request_id, model, choices))
        first = await _unless_gone(request, anext(stream, None))
    except RouteError as err:
        await stream.aclose()
        return _error(err.code, err.details)
    except _ClientGone:
        await stream.aclose()  # cancels the decode calls: their blocks are freed
        return Response(status_code=_CLIENT_GONE)
    sse_events = cancel_when_stalled(events(stream, first, request_id, model, choices, body.include_usage),
                                     router.stream_idle_timeout_s, f"HTTP {request_id}")  # fmt: skip
    return StreamingResponse(sse_events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _tokenize(router: Router, body: api.TokenizeRequest) -> Response:
    """vLLM's ``/tokenize``: ``prompt`` encoded, or ``messages`` rendered by the chat template as a chat request's
    are (a generation prompt unless ``add_generation_prompt`` is false) and encoded."""
    tokenizer = router.tokenizer
    try:
        body.check_fields()
        if tokenizer is None:
            raise ValueError("this router's model has no tokenizer (--skip-tokenizer-init)")
        if (body.prompt is None) == (body.messages is None):
            raise FieldError("prompt", "send either prompt or messages")
        if body.messages is not None:
            chat = body.chat()
            messages, tools = chat_messages(chat, router.max_context)
            num_chars = sum(map(len, chat_texts(chat)))
            add = bool(body.add_special_tokens)  # the template wrote the special tokens it wants

            def work() -> list[int]:
                return encode_chat(tokenizer, messages, tools, body.add_generation_prompt, add)
        else:
            prompt, num_chars, add = body.prompt, len(body.prompt), body.add_special_tokens is not False

            def work() -> list[int]:
                return tokenizer.encode(prompt, add_special_tokens=add)

        ids = await router.run_tokenizer(num_chars, work)
        strs = await router.run_tokenizer(len(ids), lambda: tokenizer.hf.convert_ids_to_tokens(ids)) \
            if body.return_token_strs else None  # fmt: skip
    except ValidationBusy as err:
        return _error(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
    except ValueError as err:
        return _error(grpc.StatusCode.INVALID_ARGUMENT, str(err), getattr(err, "param", None))
    return JSONResponse({"count": len(ids), "max_model_len": router.max_context, "tokens": ids, "token_strs": strs})


async def _detokenize(router: Router, body: api.DetokenizeRequest) -> Response:
    """vLLM's ``/detokenize``: the text of ``tokens``, special tokens included."""
    tokenizer = router.tokenizer
    try:
        body.check_fields()
        if tokenizer is None:
            raise ValueError("this router's model has no tokenizer (--skip-tokenizer-init)")
        try:
            check_token_ids(body.tokens, router.vocab_size, "tokens")
        except ValueError as err:
            raise FieldError("tokens", str(err)) from None
        text = await router.run_tokenizer(len(body.tokens), lambda: tokenizer.decode(body.tokens, False))
    except ValidationBusy as err:
        return _error(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
    except ValueError as err:
        return _error(grpc.StatusCode.INVALID_ARGUMENT, str(err), getattr(err, "param", None))
    return JSONResponse({"prompt": text})


async def _echo(router: Router, body: api.CompletionRequest | api.ChatCompletionRequest, proto: pb.GenerateRequest,
                chat: bool) -> str | None:  # fmt: skip
    """The prompt shown before its choices' text (completions' ``echo``: as sent, token ids decoded); None
    without ``echo``."""
    if chat or not body.echo:
        return None
    if proto.WhichOneof("prompt") == "text":
        return proto.text
    if router.tokenizer is None:
        raise ValueError("echo of token ids needs the model's tokenizer, and this router runs without one")
    ids = list(proto.token_ids.ids)
    return await router.run_tokenizer(len(ids), lambda: router.tokenizer.decode(ids))


def _error(code: grpc.StatusCode, message: str, param: str | None = None) -> JSONResponse:
    status, body = api.error(code, message, param)
    return JSONResponse(body, status_code=status)


async def _unless_gone(request: Request, work: Awaitable[_T]) -> _T:
    """``work``'s result, or ``_ClientGone`` (``work`` cancelled) as soon as the client disconnects."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with suppress(asyncio.CancelledError, RouteError):
                await task
    if task.cancelled():
        raise _ClientGone
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
