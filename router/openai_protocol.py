"""The OpenAI-compatible wire format: request bodies (pydantic), their translation into the one public
``pb.GenerateRequest``, and the JSON objects sent back (completions, chat completions, their stream chunks,
usage, errors).

Field names follow OpenAI and vLLM: ``max_tokens`` (chat also ``max_completion_tokens``), ``temperature``,
``top_p``, ``top_k``, ``seed``, ``stop`` (a string or a list), ``stop_token_ids``, ``ignore_eos``,
``repetition_penalty``, kvserve's StreamingLLM options ``streaming_window`` and ``streaming_sinks``, and
``speculative`` (false: no speculative decoding for this request).
Unknown fields are ignored, as OpenAI clients send some we do not serve (``user``).
Only types are checked here; every rule on values lives in ``rpc.validation``, which the router applies
to the ``pb.GenerateRequest`` built here, so both doors refuse the same requests with the same message.
"""

from __future__ import annotations

import time
from typing import Any

import grpc
from pydantic import BaseModel, ConfigDict

from protos.kvserve.v1 import kvserve_pb2 as pb
from rpc.requests import build_request

# gRPC status -> (HTTP status, OpenAI error type)
_HTTP_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    repetition_penalty: float | None = None
    streaming_window: int | None = None
    streaming_sinks: int | None = None
    speculative: bool | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None

    def sampling(self, max_tokens: int | None) -> dict[str, Any]:
        if self.n != 1:
            raise ValueError(f"n is {self.n}; this server returns one choice per request (n=1)")
        return {"max_tokens": max_tokens, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "seed": self.seed, "stop": self.stop, "stop_token_ids": self.stop_token_ids,
                "ignore_eos": self.ignore_eos, "repetition_penalty": self.repetition_penalty,
                "streaming_window": self.streaming_window, "streaming_sinks": self.streaming_sinks,
                "speculative": self.speculative}  # fmt: skip

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]

    def to_proto(self, request_id: str) -> pb.GenerateRequest:
        """Raises ``ValueError`` for what protobuf cannot hold (a batch of prompts, an int past 32 bits)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ValueError(f"prompt is a batch of {len(prompt)}; send one prompt per request")
            prompt = prompt[0]
        return _build(prompt, request_id, self.sampling(self.max_tokens))


class ContentPart(BaseModel):
    type: str
    text: str = ""


class ChatMessage(BaseModel):
    role: str
    content: str | list[ContentPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        if any(part.type != "text" for part in self.content):
            raise ValueError("only text content parts are served")
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None

    def to_proto(self, request_id: str) -> pb.GenerateRequest:
        messages = [{"role": m.role, "content": m.text()} for m in self.messages]
        if not messages:
            raise ValueError("messages is empty")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return _build(messages, request_id, self.sampling(max_tokens))


def _build(prompt, request_id: str, sampling: dict[str, Any]) -> pb.GenerateRequest:
    try:
        return build_request(prompt, request_id=request_id, **sampling)
    except (TypeError, ValueError) as err:  # protobuf's range checks (int32, int64)
        raise ValueError(f"a field is out of range: {err}") from None


def usage(msg: pb.GenerateResponse) -> dict[str, Any]:
    u = msg.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens}}  # fmt: skip


def completion(request_id: str, model: str, chat: bool, text: str, last: pb.GenerateResponse) -> dict[str, Any]:
    """The whole answer (``stream`` false)."""
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}}
    else:
        choice = {"index": 0, "text": text, "logprobs": None}
    choice["finish_reason"] = last.finish_reason or None
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage(last)}  # fmt: skip


def chunk(request_id: str, model: str, chat: bool, text: str, finish_reason: str | None, first: bool,
          usage_of: pb.GenerateResponse | None = None) -> dict[str, Any]:  # fmt: skip
    """One streamed event; with ``usage_of``, the closing usage event (no choices), as OpenAI sends it."""
    if usage_of is not None:
        choices = []
    elif chat:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        choices = [{"index": 0, "delta": delta, "finish_reason": finish_reason}]
    else:
        choices = [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]
    body = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices}  # fmt: skip
    if usage_of is not None:
        body["usage"] = usage(usage_of)
    return body


def error(code: grpc.StatusCode, message: str, param: str | None = None) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI error object) for a gRPC status: 400 bad input, 401 no API key, 429 full, 503 no
    worker, ..."""
    status, kind = _HTTP_ERRORS.get(code, (500, "server_error"))
    return status, error_body(message, kind, code.name.lower(), param)


def error_body(message: str, kind: str, code: str, param: str | None = None) -> dict[str, Any]:
    """An OpenAI error object; ``code`` is a gRPC status name in lower case."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
