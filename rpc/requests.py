"""Building a public ``pb.GenerateRequest`` from plain Python values: the client library and the router's
OpenAI-compatible HTTP API both use it, so that a request means the same whichever door it came through; and
the API key a client sends with it (``router.limits`` checks it).

Only protobuf is imported here (no engine, no torch): the client library stays light. Nothing is validated
here; ``rpc.validation`` does that for every request the router receives.
"""

from __future__ import annotations

import json
import os
from typing import Any

from protos.kvserve.v1 import kvserve_pb2 as pb

API_KEY_ENV = "KVSERVE_API_KEY"  # the router's API key, and the one its clients send by default
Prompt = str | list[int] | list[dict[str, Any]]
_OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "seed", "repetition_penalty", "streaming_window",
             "streaming_sinks", "speculative", "presence_penalty", "frequency_penalty", "min_tokens", "min_p",
             "logprobs", "prompt_logprobs", "n", "priority")  # fmt: skip


def build_request(
    prompt: Prompt,
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: list[str] | str | None = None,
    stop_token_ids: list[int] | None = None,
    ignore_eos: bool = False,
    repetition_penalty: float | None = None,
    streaming_window: int | None = None,
    streaming_sinks: int | None = None,
    speculative: bool | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    min_tokens: int | None = None,
    min_p: float | None = None,
    logit_bias: dict[int, float] | None = None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    n: int | None = None,
    priority: int | None = None,
    structured_outputs: dict[str, Any] | None = None,
    response_format: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    request_id: str = "",
) -> pb.GenerateRequest:
    """``prompt`` is text, token ids or chat messages (OpenAI's: ``{"role", "content"}``, an assistant's
    ``tool_calls``, a tool's ``tool_call_id``; ``tools``: OpenAI's function tools, which the chat template
    lists, ``pb.ChatMessages``); ``None`` options stay
    unset, so the server applies its defaults (``engine.sampling_params.SamplingParams`` says what each does;
    ``n``: that many choices, their messages told apart by ``GenerateResponse.index``; ``priority``: lower
    first, an int32). ``structured_outputs``
    (vLLM's) or ``response_format`` (OpenAI's) constrain the output: ``SamplingOptions.structured_output``."""
    values = locals()
    sampling = pb.SamplingOptions(
        stop=[stop] if isinstance(stop, str) else list(stop or []),
        stop_token_ids=list(stop_token_ids or []),
        ignore_eos=ignore_eos,
        logit_bias=logit_bias or {},
        **{name: values[name] for name in _OPTIONAL if values[name] is not None},
    )
    structured = structured_output(structured_outputs, response_format)
    if structured is not None:
        sampling.structured_output.CopyFrom(structured)
    request = pb.GenerateRequest(request_id=request_id, sampling=sampling)
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, pb.ChatMessages):
        request.chat.CopyFrom(prompt)
    elif prompt and isinstance(prompt[0], dict):
        request.chat.messages.extend(map(chat_message, prompt))
        request.chat.tools.extend(map(tool, tools or []))
    else:
        request.token_ids.ids.extend(prompt)
        request.token_ids.SetInParent()  # an empty list is still "token_ids", so the server can say it is empty
    if tools and request.WhichOneof("prompt") != "chat":
        raise ValueError("tools are listed by the chat template: send chat messages with them")
    return request


def chat_message(message: dict[str, Any]) -> pb.ChatMessage:
    """An OpenAI chat message (``content`` a string or null) on the wire."""
    calls = [pb.ToolCall(id=c.get("id", ""), name=c["function"]["name"], arguments=_json_text(c["function"].get(
        "arguments", "{}"))) for c in message.get("tool_calls") or []]  # fmt: skip
    return pb.ChatMessage(role=message["role"], content=message.get("content") or "", name=message.get("name") or "",
                          tool_call_id=message.get("tool_call_id") or "", tool_calls=calls)  # fmt: skip


def tool(spec: dict[str, Any]) -> pb.Tool:
    """An OpenAI function tool (``{"type": "function", "function": {"name", "description", "parameters"}}``) on
    the wire."""
    if spec.get("type", "function") != "function" or not isinstance(spec.get("function"), dict):
        raise ValueError("a tool must be {'type': 'function', 'function': {'name', 'description', 'parameters'}}")
    function = spec["function"]
    parameters = function.get("parameters")
    return pb.Tool(name=function.get("name", ""), description=function.get("description") or "",
                   parameters="" if parameters is None else _json_text(parameters))  # fmt: skip


def _json_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def structured_output(structured_outputs: dict[str, Any] | None = None,
                      response_format: dict[str, Any] | None = None) -> pb.StructuredOutput | None:  # fmt: skip
    """The wire's ``StructuredOutput`` of vLLM's ``structured_outputs`` (exactly one of ``json``: a schema, as
    an object or JSON text; ``regex``; ``choice``: a list of strings; ``grammar``: EBNF; ``json_object``: true)
    or of OpenAI's ``response_format`` (``{"type": "json_object"}``, or ``{"type": "json_schema", "json_schema":
    {"name", "schema", "strict"}}``; ``{"type": "text"}`` asks for nothing). None when neither asks for
    anything; ``ValueError``, naming the field, for one that says no one thing. The grammar itself is checked
    by ``rpc.validation``."""
    from_format = _from_response_format(response_format) if response_format is not None else None
    if structured_outputs is None:
        return from_format
    if from_format is not None:
        raise ValueError("structured_outputs and response_format both constrain the output: send one of them")
    if not isinstance(structured_outputs, dict):
        raise ValueError("structured_outputs must be an object")
    unknown = sorted(set(structured_outputs) - set(_STRUCTURED_KINDS))
    if unknown:
        raise ValueError(f"structured_outputs.{unknown[0]} is not served; set one of {list(_STRUCTURED_KINDS)}")
    kinds = [k for k in _STRUCTURED_KINDS if structured_outputs.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise ValueError(f"structured_outputs must set exactly one of {list(_STRUCTURED_KINDS)}, got "
                         f"{kinds or 'none'}")  # fmt: skip
    kind, value = kinds[0], structured_outputs[kinds[0]]
    if kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    if kind == "json":
        return pb.StructuredOutput(json_schema=value if isinstance(value, str) else json.dumps(value))
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise ValueError("structured_outputs.choice must be a list of strings")
        return pb.StructuredOutput(choice=pb.ChoiceList(choices=value))
    if not isinstance(value, str):
        raise ValueError(f"structured_outputs.{kind} must be a string")
    return pb.StructuredOutput(**{kind: value})


def _from_response_format(response_format: dict[str, Any]) -> pb.StructuredOutput | None:
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    if kind != "json_schema":
        raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict | bool):
        raise ValueError("response_format.json_schema.schema is required: the JSON schema the output must match")
    return pb.StructuredOutput(json_schema=json.dumps(spec["schema"]))


def resolve_api_key(given: str | None = None) -> str | None:
    """The API key: ``given``, else ``$KVSERVE_API_KEY``; None when neither is set (or only blanks)."""
    return (given if given is not None else os.environ.get(API_KEY_ENV, "")).strip() or None


def api_key_metadata(given: str | None = None) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata carrying the API key (``resolve_api_key``) as the router expects it, if there is one."""
    key = resolve_api_key(given)
    return (("authorization", f"Bearer {key}"),) if key else ()
