"""The OpenAI-compatible wire format: request bodies (pydantic), their translation into the public
``pb.GenerateRequest`` (one per prompt), and error objects (the answers: ``router.openai_response``).

Field names follow OpenAI and vLLM: ``max_tokens`` (chat also ``max_completion_tokens``), ``temperature``,
``top_p``, ``top_k``, ``seed``, ``stop`` (a string or a list), ``stop_token_ids``, ``ignore_eos``,
``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``, ``min_tokens``, ``min_p``, ``logit_bias``,
log-probabilities (completions: ``logprobs`` k and ``echo``; chat: ``logprobs`` and ``top_logprobs``; both:
vLLM's ``prompt_logprobs``), kvserve's StreamingLLM options ``streaming_window`` and ``streaming_sinks``,
``speculative`` (false: no speculative decoding for this request), structured outputs (OpenAI's
``response_format``: ``json_object``, ``json_schema``; vLLM's ``structured_outputs``: ``rpc.requests``), ``n``
(that many choices of each prompt, at most 16; completions' ``best_of`` only equal to it) and, for completions,
a ``prompt`` that is a list of prompts (texts or token-id lists: choice ``i * n + j`` is prompt i's sample j).
Fields declared nowhere here go to ``router.openai_fields``: OpenAI's that kvserve does not implement are
refused unless their value asks for nothing, the rest are ignored.
Only types are checked here; every rule on values lives in ``rpc.validation``, which the router applies
to the ``pb.GenerateRequest`` built here, so both doors refuse the same requests with the same message.
Chat messages: ``developer`` is rendered as ``system``; a ``tool`` message needs its ``tool_call_id``; an
assistant message may carry ``tool_calls`` and no content. ``tools``, ``tool_choice`` and
``parallel_tool_calls``: ``router.openai_tools``.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, Literal

import grpc
from pydantic import BaseModel, ConfigDict

from protos.kvserve.v1 import kvserve_pb2 as pb
from router.openai_fields import FieldError, check_extra_fields
from router.openai_tools import ToolChoice, ToolDefinition, ToolPlan, plan, shown_choice
from rpc.requests import build_request, structured_output, tool

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
    include_usage: bool = False  # (include_obfuscation pads deltas against a side channel: ignored)


class _Body(BaseModel):
    """A request body: declared fields typed, the others kept for ``check_fields``."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None

    def check_fields(self) -> None:
        """``FieldError`` for an undeclared field that asks for what kvserve does not implement."""
        check_extra_fields(self.model_extra or {})


class _Common(_Body):
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
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_tokens: int | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None  # vLLM's: the prompt's log-probabilities, without echoing it
    n: int | None = None  # choices per prompt (rpc.validation: at most 16)
    priority: int | None = None  # vLLM's: lower first, an int32 (rpc.validation)
    response_format: dict[str, Any] | None = None  # OpenAI's: text, json_object or json_schema
    structured_outputs: dict[str, Any] | None = None  # vLLM's: one of json, regex, choice, grammar, json_object
    stream: bool = False
    stream_options: StreamOptions | None = None

    def sampling(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None) -> dict[str, Any]:
        return {"max_tokens": max_tokens, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "seed": self.seed, "stop": self.stop, "stop_token_ids": self.stop_token_ids,
                "ignore_eos": self.ignore_eos, "repetition_penalty": self.repetition_penalty,
                "streaming_window": self.streaming_window, "streaming_sinks": self.streaming_sinks,
                "speculative": self.speculative, "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty, "min_tokens": self.min_tokens, "min_p": self.min_p,
                "logit_bias": _token_bias(self.logit_bias), "logprobs": logprobs,
                "prompt_logprobs": self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
                "n": self.n, "priority": self.priority, "response_format": self.response_format,
                "structured_outputs": self.structured_outputs}  # fmt: skip

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: bool | int | None = None  # each token's and its k most likely alternatives (k <= 20); false: none
    echo: bool | None = None  # the prompt before the completion, with its log-probabilities when logprobs is set
    best_of: int | None = None  # candidates per prompt: only n of them (none are ranked away)

    def to_protos(self, request_id: str) -> list[pb.GenerateRequest]:
        """One request per prompt (ids ``<request_id>-<i>`` for a list of several). Raises ``ValueError`` for
        what protobuf cannot hold (an int past 32 bits)."""
        if self.logprobs is True:
            raise FieldError("logprobs", "logprobs of a completion is a count of alternatives (0 to 20), not true")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise FieldError("best_of", f"best_of={self.best_of} is not implemented by this server (no candidates "
                             f"are ranked away); leave it out or send n={self.n or 1}")  # fmt: skip
        logprobs = None if self.logprobs is False else self.logprobs
        sampling = self.sampling(self.max_tokens, logprobs, logprobs if self.echo else None)
        prompts = _prompts(self.prompt)
        if len(prompts) == 1:
            return [_build(prompts[0], request_id, sampling)]
        return [_build(prompt, f"{request_id}-{i}", sampling) for i, prompt in enumerate(prompts)]


class ContentPart(BaseModel):
    type: str
    text: str = ""


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool: the call it answers

    def text(self, i: int) -> str:
        """The content as one text; ``FieldError`` for a part that is not text, or no content where one is due."""
        if self.content is None:
            if self.role == "assistant" and self.tool_calls:
                return ""
            raise FieldError(f"messages.{i}.content", f"messages[{i}] ({self.role}) has no content")
        if isinstance(self.content, str):
            return self.content
        for j, part in enumerate(self.content):
            if part.type != "text":
                raise FieldError(f"messages.{i}.content", f"messages[{i}].content[{j}] is of type {part.type[:32]!r}; "
                                 "only text content parts are served")  # fmt: skip
        return "".join(part.text for part in self.content)

    def to_proto(self, i: int) -> pb.ChatMessage:
        """Message ``i`` on the wire; ``FieldError`` for a tool message that names no call (``rpc.chat`` refuses
        it too, for gRPC; here the error names the field)."""
        if self.role == "tool" and not self.tool_call_id:
            message = f"messages[{i}] has role tool and no tool_call_id: name the tool call it answers"
            raise FieldError(f"messages.{i}.tool_call_id", message)
        calls = [pb.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
                 for c in self.tool_calls or []]  # fmt: skip
        return pb.ChatMessage(role=_ROLE_AS.get(self.role, self.role), content=self.text(i), name=self.name or "",
                              tool_call_id=self.tool_call_id or "", tool_calls=calls)  # fmt: skip


def chat_proto(messages: list[ChatMessage], tools: list[dict[str, Any]]) -> pb.ChatMessages:
    """The wire's conversation (``rpc.chat`` renders it); ``tools``: those the template lists."""
    if not messages:
        raise FieldError("messages", "messages is empty")
    return pb.ChatMessages(messages=[m.to_proto(i) for i, m in enumerate(messages)], tools=[tool(t) for t in tools])


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None  # with logprobs: that many alternatives per token (<= 20)
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None  # router.openai_tools
    parallel_tool_calls: bool | None = None

    @cached_property
    def tool_plan(self) -> ToolPlan:
        return plan(self.tools, self.tool_choice, self.parallel_tool_calls)

    def to_proto(self, request_id: str) -> pb.GenerateRequest:
        """Unset ``max_tokens``: the router gives a chat the rest of the context (``rpc.validation``)."""
        chat = chat_proto(self.messages, self.tool_plan.tools)
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        sampling = self.sampling(max_tokens, logprobs, None)
        if self.tool_plan.structured_outputs is not None:
            if sampling["structured_outputs"] is not None or sampling["response_format"] is not None:
                raise FieldError("tool_choice", f"tool_choice={shown_choice(self.tool_choice)} constrains the "
                                 "output, and so do response_format and structured_outputs: send one")  # fmt: skip
            sampling["structured_outputs"] = self.tool_plan.structured_outputs
        return _build(chat, request_id, sampling)


_ROLE_AS = {"developer": "system"}  # OpenAI's name for system messages to newer models


class TokenizeRequest(_Body):
    """vLLM's ``/tokenize``: a prompt, or chat messages (and tools) rendered with the chat template."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDefinition] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template has them)
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    def chat(self) -> pb.ChatMessages:
        return chat_proto(self.messages or [], [t.model_dump(exclude_none=True) for t in self.tools or []])


class DetokenizeRequest(_Body):
    tokens: list[int]


def _prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """The prompts of a completions ``prompt``: one (text or token ids), or a list of them."""
    if isinstance(prompt, list) and not prompt:
        raise FieldError("prompt", "prompt is an empty list; send a prompt (text or token ids) or a list of them")
    if isinstance(prompt, list) and isinstance(prompt[0], str | list):
        return list(prompt)
    return [prompt]


def _token_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (JSON object keys are strings) with token-id keys; ``FieldError`` for a key that
    is not one."""
    if bias is None:
        return None
    try:
        return {int(key): value for key, value in bias.items()}
    except ValueError:
        bad = next(key for key in bias if not key.lstrip("-").isdigit())
        raise FieldError("logit_bias", f"logit_bias key {bad[:32]!r} is not a token id") from None


def _build(prompt, request_id: str, sampling: dict[str, Any]) -> pb.GenerateRequest:
    try:
        structured_output(sampling["structured_outputs"], sampling["response_format"])
    except ValueError as err:  # (the message names the field)
        param = "structured_outputs" if str(err).startswith("structured_outputs") else "response_format"
        raise FieldError(param, str(err)) from None
    try:
        return build_request(prompt, request_id=request_id, **sampling)
    except (TypeError, ValueError) as err:  # protobuf's range checks (int32, int64)
        raise ValueError(f"a field is out of range: {err}") from None


def error(code: grpc.StatusCode, message: str, param: str | None = None) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI error object) for a gRPC status: 400 bad input, 401 no API key, 429 full, 503 no
    worker, ..."""
    status, kind = _HTTP_ERRORS.get(code, (500, "server_error"))
    return status, error_body(message, kind, code.name.lower(), param)


def error_body(message: str, kind: str, code: str, param: str | None = None) -> dict[str, Any]:
    """An OpenAI error object; ``code`` is a gRPC status name in lower case, or OpenAI's own (``model_not_found``)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
