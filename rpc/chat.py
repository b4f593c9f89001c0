"""Chat messages and tools into the prompt's token ids, through the model's own chat template.

A ``pb.ChatMessages`` holds OpenAI's conversation: messages of the roles in ``CHAT_ROLES`` (an assistant's
may carry ``tool_calls`` and no content; a ``tool`` message answers one call, named by ``tool_call_id``) and
the ``tools`` (functions) the model may call. The template gets them as transformers documents it:
``messages`` with ``tool_calls`` as ``{"id", "type": "function", "function": {"name", "arguments": <object>}}``
(arguments parsed from their JSON text, as vLLM hands them over) and ``tools`` as OpenAI's function objects.

A template that does not render tools (SmolLM2's does not) still lets the model see them, in the Hermes
format that Qwen2.5 and Qwen3 were tuned on (``TOOL_CALL_FORMATS``): a system block listing the functions and
asking for ``<tool_call>`` JSON, and each earlier call written into its assistant message in that format.
``tool_call_format`` says which format a template's model writes its calls in, for the HTTP door's parser
(``router.openai_tools``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError

from engine.tokenizer import Tokenizer
from protos.kvserve.v1 import kvserve_pb2 as pb

CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_TOOLS = 128  # OpenAI's limit
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function name
TOOL_CALL_FORMATS = ("hermes", "llama3_json")


def chat_messages(chat: pb.ChatMessages, max_context: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(messages, tools) as the chat template takes them; ``ValueError`` naming the message or tool that is
    not well formed."""
    if not chat.messages:
        raise ValueError("chat has no messages")
    if len(chat.messages) >= max_context:  # every message renders as at least one token
        raise ValueError(f"chat has {len(chat.messages)} messages; the model's context is {max_context} tokens")
    return [_message(i, m) for i, m in enumerate(chat.messages)], _tools(chat.tools)


def chat_texts(chat: pb.ChatMessages) -> list[str]:
    """A chat's texts: what it weighs before tokenizing (contents, call arguments, tool descriptions and schemas)."""
    texts = [m.content for m in chat.messages] + [c.arguments for m in chat.messages for c in m.tool_calls]
    return texts + [t.description + t.parameters for t in chat.tools]


def encode_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                add_generation_prompt: bool = True, add_special_tokens: bool = False) -> list[int]:  # fmt: skip
    """Chat messages' token ids, rendered by the model's chat template (``template_input``); ``ValueError``
    when the template refuses them."""
    messages, tools = template_input(messages, tools or [], str(tokenizer.hf.chat_template or ""))
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt, tools)
    except TemplateError as err:
        raise ValueError(f"the model's chat template refused these messages: {err}") from err
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def template_input(messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                   template: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:  # fmt: skip
    """(messages, tools) as ``template`` gets them. What it renders itself it gets as it came; where it does not
    render ``tool_calls``, each assistant's calls are written into its content, and where it does not render
    ``tools``, they go into a Hermes system block (then the template gets no ``tools``)."""
    out = messages
    if "tool_calls" not in template:
        out = [m | {"content": "\n".join(filter(None, [m["content"], *map(hermes_call, m["tool_calls"])]))}
               if m.get("tool_calls") else m for m in messages]  # fmt: skip
    if not tools or "tools" in template:
        return out, tools or None
    block = _hermes_tools_block(tools)
    if out and out[0]["role"] == "system":
        return [out[0] | {"content": f"{out[0]['content']}\n\n{block}"}, *out[1:]], None
    return [{"role": "system", "content": block}, *out], None


def tool_call_format(template: str) -> str:
    """The format in which the model of ``template`` writes its tool calls: Llama 3's JSON where the template
    speaks of ``<|python_tag|>`` or the ``ipython`` role, else Hermes' ``<tool_call>`` (also what
    ``template_input`` asks of a model whose template has no tools)."""
    return "llama3_json" if "<|python_tag|>" in template or "ipython" in template else "hermes"


def hermes_call(call: dict[str, Any]) -> str:
    """One tool call in the Hermes format."""
    body = {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def _hermes_tools_block(tools: list[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return ("# Tools\n\nYou can call the functions below to help with the user's request. Their signatures are "
            f"inside <tools></tools>:\n<tools>\n{listed}\n</tools>\n\nTo call a function, answer with a JSON "
            'object of its name and arguments inside <tool_call></tool_call> tags, one per call:\n<tool_call>\n'
            '{"name": <function name>, "arguments": <arguments object>}\n</tool_call>')  # fmt: skip


def _message(i: int, m: pb.ChatMessage) -> dict[str, Any]:
    if m.role not in CHAT_ROLES:
        raise ValueError(f"chat message {i} has role {m.role[:32]!r}; use one of {list(CHAT_ROLES)}")
    if m.role == "tool" and not m.tool_call_id:
        raise ValueError(f"chat message {i} has role tool and no tool_call_id: name the tool call it answers")
    if m.tool_calls and m.role != "assistant":
        raise ValueError(f"chat message {i} has tool_calls but role {m.role!r}; only an assistant calls tools")
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.name:
        out["name"] = m.name
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [_call(i, j, call) for j, call in enumerate(m.tool_calls)]
    return out


def _call(i: int, j: int, call: pb.ToolCall) -> dict[str, Any]:
    where = f"chat message {i} tool_calls[{j}]"
    if not TOOL_NAME.fullmatch(call.name):
        raise ValueError(f"{where} calls {call.name[:70]!r}: a function name is 1 to 64 of a-z, A-Z, 0-9, _ and -")
    try:
        arguments = json.loads(call.arguments or "{}")
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}.function.arguments is not JSON ({err.msg}); send the arguments object "
                         "as JSON text") from None  # fmt: skip
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


def _tools(tools: Sequence[pb.Tool]) -> list[dict[str, Any]]:
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"{len(tools)} tools; at most {MAX_TOOLS} are allowed")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        if not TOOL_NAME.fullmatch(tool.name):
            raise ValueError(f"tools[{i}] is named {tool.name[:70]!r}: a function name is 1 to 64 of a-z, A-Z, "
                             "0-9, _ and -")  # fmt: skip
        if tool.name in seen:
            raise ValueError(f"tools[{i}]: a second function named {tool.name!r}; names must be unique")
        seen.add(tool.name)
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        function["parameters"] = _parameters(i, tool.parameters)
        out.append({"type": "function", "function": function})
    return out


def _parameters(i: int, text: str) -> dict[str, Any]:
    if not text:
        return {"type": "object", "properties": {}}
    try:
        parameters = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"tools[{i}].function.parameters is not JSON ({err.msg})") from None
    if not isinstance(parameters, dict):
        raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
    return parameters
