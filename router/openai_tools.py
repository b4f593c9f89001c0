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

Streaming (``ToolCallStream``) sends OpenAI's deltas: content as it comes, until a call may begin; then each
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

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*(?=\{)')
_HELD_TAIL = "} \t\r\n"  # a streamed call's arguments keep these back: they may close the call, not them


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
        start = text.find(_HERMES_OPEN)
        calls = _hermes_calls(text[start:]) if start >= 0 else []
        content = text[:start] if calls else text
    else:
        calls = (_required_calls(text) if mode == "required" else _llama3_calls(text)) or []
        content = "" if calls else text
    return (content if content.strip() or not calls else None), calls[: None if parallel else 1]


def _hermes_calls(text: str) -> list[Call]:
    """The calls of ``<tool_call>`` bodies (the last may be unclosed if the answer ends in it), up to the first
    that does not parse."""
    calls = []
    for body in text.split(_HERMES_OPEN)[1:]:
        call = _call(body.split(_HERMES_CLOSE)[0])
        if call is None:
            break
        calls.append(call)
    return calls


def _llama3_calls(text: str) -> list[Call] | None:
    """The calls of an answer that is only ``{"name", "parameters"}`` objects separated by ``;``."""
    text = text.strip().removeprefix(_PYTHON_TAG).strip()
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


def _call(body: str) -> Call | None:
    """The call of a Hermes body; its arguments as the model wrote them when they follow the name (so that
    pieces streamed from the text add up to them), else as JSON re-serialized."""
    head = _HERMES_HEAD.match(body)
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


class ToolCallStream:
    """One choice's answer, streamed as OpenAI's deltas: ``feed`` each text piece, then ``finish``; each
    returns (content, tool-call deltas). The content sent and the calls add up to what ``parse`` makes of the
    whole text (only the calls' ids differ)."""

    def __init__(self, mode: str, fmt: str, name: str = "", parallel: bool = True) -> None:
        self.mode: str | None = mode
        self.fmt, self.name, self.parallel = fmt, name, parallel
        self.text = ""
        self.calls: list[Call] = []
        self._sent = 0  # characters of text accounted for: sent as content, or inside a call already sent
        self._content_started = False  # blank content before a call is not content: held until text shows
        self._held = False  # the rest waits for the answer's end (Llama 3, required, or a call that failed)
        self._open: tuple[int, int, int] | None = None  # a Hermes call whose arguments stream: (index, start, sent)

    @property
    def made_calls(self) -> bool:
        """Whether the answer's finish_reason is "tool_calls"."""
        return self.mode in ("auto", "required") and bool(self.calls)

    def feed(self, piece: str) -> tuple[str, list[dict[str, Any]]]:
        self.text += piece
        if self.mode == "named":
            return "", self._named(piece)
        if self.mode == "required" or self._held:
            return "", []
        if self.mode == "auto" and self.fmt == "llama3_json":
            head = self.text.lstrip()
            if head.startswith(("{", _PYTHON_TAG)):
                self._held = True
            if self._held or not head or _PYTHON_TAG.startswith(head):
                return "", []
            self.mode = None  # not a call: plain text, sent as it comes
        return self._hermes() if self.mode == "auto" else (self._content(len(self.text)), [])

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The rest, once the answer has ended."""
        if self.mode == "named":
            return "", [] if self.calls else self._named("")
        if self.mode is None:
            return self._content(len(self.text), force=True), []
        if self._open is not None:  # Hermes: the streaming call never closed
            return "", self._close(_call(self.text[self._body_start():]), len(self.text))
        if self.calls:  # Hermes: a last call that never closed
            start = self.text.find(_HERMES_OPEN, self._sent)
            more = [] if self._held or start < 0 else _hermes_calls(self.text[start:])
            return "", self._add(more)
        _, calls = parse(self.mode, self.fmt, self.text)
        if not calls:
            return self._content(len(self.text), force=True), []
        self._sent = len(self.text)
        return "", self._add(calls)

    def _named(self, piece: str) -> list[dict[str, Any]]:
        if self.calls:
            return [{"index": 0, "function": {"arguments": piece}}] if piece else []
        self.calls.append(Call(self.name, ""))
        call = self.calls[0].body()
        call["function"]["arguments"] = piece
        return [{"index": 0} | call]

    def _hermes(self) -> tuple[str, list[dict[str, Any]]]:
        """Content up to a possible ``<tool_call>``; each call's name once it shows, then its arguments as they
        come (a call whose name does not come first: whole, once it closes)."""
        deltas: list[dict[str, Any]] = []
        content = ""
        while not self._held:
            start = self.text.find(_HERMES_OPEN, self._sent)
            if start < 0:
                if not self.calls:  # text after the calls is not content (as parse has it)
                    content += self._content(len(self.text) - _partial_tag(self.text, _HERMES_OPEN))
                break
            if not self.calls:
                content += self._content(start)
            body = start + len(_HERMES_OPEN)
            end = self.text.find(_HERMES_CLOSE, body)
            if end < 0:
                deltas += self._stream_arguments(body)
                break
            call = _call(self.text[body:end])
            if call is None and self._open is None:  # the rest waits for finish (no call yet: all content)
                self._held = True
                break
            self._sent = end + len(_HERMES_CLOSE)
            deltas += self._close(call, end) if self._open is not None else self._add([call])
        return content, deltas

    def _stream_arguments(self, body: int) -> list[dict[str, Any]]:
        """The open call's name (once), then what of its arguments cannot still turn out to close it."""
        deltas = []
        if self._open is None:
            head = _HERMES_HEAD.match(self.text, body)
            if head is None or not (self.parallel or not self.calls):
                return []
            deltas = self._add([Call(head.group(1), "")])
            self._open = (len(self.calls) - 1, head.end(), 0)
        _, start, sent = self._open
        safe = len(self.text) - _partial_tag(self.text, _HERMES_CLOSE)
        safe = max(len(self.text[:safe].rstrip(_HELD_TAIL)), start + sent)
        return deltas + self._arguments(self.text[start + sent: safe])

    def _close(self, call: Call | None, end: int) -> list[dict[str, Any]]:
        """The rest of the streaming call's arguments, its body ending at ``end``: as parsed, or, where the
        body turned out malformed, as written up to the call's closing brace."""
        index, start, sent = self._open
        written = self.text[start:end].rstrip()
        arguments = call.arguments if call is not None else written.removesuffix("}").rstrip()
        if not arguments.startswith(self.text[start: start + sent]):
            arguments = written  # (a call that parsed whole but not as streamed: what was written stands)
        return self._arguments(arguments[sent:], final=arguments)

    def _arguments(self, piece: str, final: str | None = None) -> list[dict[str, Any]]:
        index, start, sent = self._open
        self.calls[index].arguments += piece
        self._open = None if final is not None else (index, start, sent + len(piece))
        return [{"index": index, "function": {"arguments": piece}}] if piece else []

    def _body_start(self) -> int:
        return self.text.find(_HERMES_OPEN, self._sent) + len(_HERMES_OPEN)

    def _content(self, upto: int, force: bool = False) -> str:
        piece = self.text[self._sent: upto]
        if not (force or self._content_started or piece.strip()):
            return ""
        self._content_started = self._content_started or bool(piece)
        self._sent = max(self._sent, upto)
        return piece

    def _add(self, calls: list[Call]) -> list[dict[str, Any]]:
        if not self.parallel:
            calls = calls[: max(0, 1 - len(self.calls))]
        first = len(self.calls)
        self.calls += calls
        return [{"index": first + i} | call.body() for i, call in enumerate(calls)]


def _partial_tag(text: str, tag: str) -> int:
    """How many of ``text``'s last characters could begin ``tag``: held back until the next piece says."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
