"""Tool calling on the HTTP door: OpenAI's ``tools`` and ``tool_choice`` into what the model is asked, and its
answer back into ``tool_calls``.

``tool_choice`` (default: ``auto`` with tools, ``none`` without them):

* ``none``: the tools are not rendered and the answer is text (vLLM's ``--exclude-tools-when-tool-choice-none``);
* ``auto``: the chat template lists the tools (``rpc.chat``) and the answer is read in the model's own format
  (``--tool-call-parser``; ``auto``: ``rpc.chat.tool_call_format`` of the template):
  * ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one per call (Qwen2.5, Qwen3,
    and what ``rpc.chat`` asks of a model whose template has no tools); text before the first call is the
    content;
  * ``llama3_json``: an answer that is one or more ``{"name": ..., "parameters": {...}}`` objects separated by
    ``;`` (after an optional ``<|python_tag|>``), Llama 3.1's JSON tool calling.

  Text that does not parse as calls stays the answer's content: no call is ever made up;
* ``required``: structured outputs constrain the answer to a JSON array of ``{"name", "arguments"}`` of the
  listed functions, each ``arguments`` valid against its function's schema (exactly one with
  ``parallel_tool_calls: false``);
* a named function (``{"type": "function", "function": {"name": ...}}``): the answer is constrained to that
  function's arguments schema, and is its one call (finish_reason "stop", as OpenAI says for a forced call).

With ``auto``, ``parallel_tool_calls: false`` keeps the first call the model wrote.

Streaming (``router.tool_call_stream.ToolCallStream``) sends OpenAI's deltas: content as it comes, until a call
may begin; then each
call's first delta ``{"index", "id", "type", "function": {"name", "arguments": ""}}`` and its arguments piece
by piece (``{"index", "function": {"arguments"}}``). That is how a named call and an ``auto`` Hermes call whose
name comes first stream; the last few characters wait until the next piece shows whether they close the call.
Other Hermes calls are sent whole once ``</tool_call>`` closes them; ``required`` and Llama 3 calls, whose end
only the answer's end shows, at the end. A streamed call whose arguments turn out malformed (or are cut by
``max_tokens``) ends with them as written, where the whole answer would be text. ``finish_reason`` is
"tool_calls" when an ``auto`` or ``required`` answer made calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from engine.structured_output import StructuredOutput
from router.openai_fields import FieldError

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*(?=\{)')


class FunctionDefinition(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the arguments always match the schema only where the output is constrained


class ToolDefinition(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's ``tools``/``tool_choice`` ask: the tools the template lists (OpenAI's objects),
    how the answer is read (``mode``: None for plain text, "auto", "required" or "named") and the structured
    output that enforces it (vLLM's ``structured_outputs`` shape; None for none)."""

    tools: list[dict[str, Any]]
    mode: str | None = None
    name: str = ""  # the named function
    structured_outputs: dict[str, Any] | None = None
    parallel: bool = True


def plan(tools: list[ToolDefinition] | None, choice: ToolChoice | None, parallel: bool | None) -> ToolPlan:
    """The ``ToolPlan`` of a request, or ``FieldError`` naming ``tool_choice`` or the tool that is wrong."""
    tools = tools or []
    choice = choice if choice is not None else ("auto" if tools else "none")
    parallel = parallel is not False
    if choice == "none" or (choice == "auto" and not tools):
        return ToolPlan([])
    if not tools:
        raise FieldError("tool_choice", f"tool_choice={shown_choice(choice)} needs tools; send tools, or leave "
                         "tool_choice out")  # fmt: skip
    specs = [tool.model_dump(exclude_none=True) for tool in tools]
    if choice == "auto":
        return ToolPlan(specs, "auto", parallel=parallel)
    schemas = {tool.function.name: _schema(i, tool.function) for i, tool in enumerate(tools)}
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for name, schema in schemas.items()]  # fmt: skip
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}} | ({} if parallel else {"maxItems": 1})
        return ToolPlan(specs, "required", structured_outputs={"json": array}, parallel=parallel)
    name = choice.function.name
    if name not in schemas:
        raise FieldError("tool_choice", f"tool_choice names the function {name[:64]!r}, which is not among the "
                         f"tools: {list(schemas)[:16]}")  # fmt: skip
    return ToolPlan(specs, "named", name, {"json": schemas[name]}, parallel)


def _schema(i: int, function: FunctionDefinition) -> dict[str, Any]:
    """A function's arguments schema, checked as structured outputs will compile it."""
    schema = function.parameters if function.parameters is not None else {"type": "object", "properties": {}}
    try:
        StructuredOutput.json(schema).validate()
    except ValueError as err:
        raise FieldError(f"tools.{i}.function.parameters", f"tools[{i}].function.parameters: {err}") from None
    return schema


def shown_choice(value: Any) -> str:
    """A ``tool_choice`` as JSON, cut short for a message."""
    return json.dumps(value.model_dump() if isinstance(value, BaseModel) else value)[:64]


# -- reading calls out of an answer ---------------------------------------------------------------------------


@dataclass
class Call:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def body(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse(mode: str, fmt: str, text: str, name: str = "", parallel: bool = True) -> tuple[str | None, list[Call]]:
    """(content, calls) of a whole answer: what a non-streamed reply says. No call: the text is the content."""
    if mode == "named":
        return None, [Call(name, text)]
    if mode == "auto" and fmt == "hermes":
        start = text.find(HERMES_OPEN)
        calls = hermes_calls(text[start:]) if start >= 0 else []
        content = text[:start] if calls else text
    else:
        calls = (_required_calls(text) if mode == "required" else _llama3_calls(text)) or []
        content = "" if calls else text
    return (content if content.strip() or not calls else None), calls[: None if parallel else 1]


def hermes_calls(text: str) -> list[Call]:
    """The calls of ``<tool_call>`` bodies (the last may be unclosed if the answer ends in it), up to the first
    that does not parse."""
    calls = []
    for body in text.split(HERMES_OPEN)[1:]:
        call = hermes_call(body.split(HERMES_CLOSE)[0])
        if call is None:
            break
        calls.append(call)
    return calls


def _llama3_calls(text: str) -> list[Call] | None:
    """The calls of an answer that is only ``{"name", "parameters"}`` objects separated by ``;``."""
    text = text.strip().removeprefix(PYTHON_TAG).strip()
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        call = _call_of(value)
        if call is None:
            return None
        calls.append(call)
        rest = text[at:].lstrip()
        if rest and not rest.startswith(";"):
            return None
        at = len(text) - len(rest.removeprefix(";").lstrip())
    return calls or None


def _required_calls(text: str) -> list[Call] | None:
    try:
        values = json.loads(text)
    except json.JSONDecodeError:
        return None  # cut short (max_tokens): the text is what there is
    calls = [_call_of(v) for v in values] if isinstance(values, list) else [None]
    return None if None in calls or not calls else calls


def hermes_call(body: str) -> Call | None:
    """The call of a Hermes body; its arguments as the model wrote them when they follow the name (so that
    pieces streamed from the text add up to them), else as JSON re-serialized."""
    head = HERMES_HEAD.match(body)
    if head is not None:
        try:
            arguments, end = json.JSONDecoder().raw_decode(body, head.end())
        except json.JSONDecodeError:
            return None
        if isinstance(arguments, dict) and re.fullmatch(r"\s*\}\s*", body[end:]):
            return Call(head.group(1), body[head.end(): end])
    try:
        return _call_of(json.loads(body))
    except json.JSONDecodeError:
        return None


def _call_of(value: Any) -> Call | None:
    """A call from ``{"name", "arguments"}`` (or Llama 3's ``"parameters"``); None for anything else."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text already
        return Call(value["name"], arguments)
    if not isinstance(arguments, dict):
        return None
    return Call(value["name"], json.dumps(arguments, ensure_ascii=False))
