"""Tool calling without a server: rendering tools and calls through the chat template (``rpc.chat``), what
``tool_choice`` asks (``router.openai_tools.plan``), and reading calls out of an answer, whole (``parse``) and
streamed (``ToolCallStream``), whose deltas must add up to the whole answer's reading."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from engine.tokenizer import Tokenizer
from protos.kvserve.v1 import kvserve_pb2 as pb
from router.openai_fields import FieldError
from router.openai_protocol import ChatCompletionRequest
from router.openai_tools import parse
from router.tool_call_stream import ToolCallStream
from rpc.chat import MAX_TOOLS, chat_messages, encode_chat, tool_call_format
from rpc.requests import build_request

TEMPLATES = Path(__file__).parents[1] / "support" / "chat_templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
USER = {"role": "user", "content": "Weather in Paris?"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOL_TURN = [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
             {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]  # fmt: skip


def _rendered(tokenizer: Tokenizer, messages: list[dict], tools: list[dict]) -> str:
    chat = build_request(messages, tools=tools).chat
    return tokenizer.decode(encode_chat(tokenizer, *chat_messages(chat, 4096)), skip_special_tokens=False)


def test_the_bundled_template_gets_the_tools_and_calls_in_hermes_format(model_dir):
    text = _rendered(Tokenizer(model_dir), [{"role": "system", "content": "Be brief."}, *TOOL_TURN], [WEATHER])
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(WEATHER) in system and "<tool_call>" in system  # the tool listed, and the format asked for
    assert rest == ("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
                    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
                    "<|im_start|>tool\n18 C, sunny<|im_end|>\n<|im_start|>assistant\n")  # fmt: skip
    without_system = _rendered(Tokenizer(model_dir), [USER], [WEATHER])
    assert without_system.startswith("<|im_start|>system\n# Tools\n")


def test_a_template_that_knows_tools_renders_them_itself(model_dir):
    tokenizer = Tokenizer(model_dir)
    tokenizer.hf.chat_template = (TEMPLATES / "qwen3.jinja").read_text()
    text = _rendered(tokenizer, TOOL_TURN, [WEATHER, TIME])
    assert "<tools>\n" + json.dumps(WEATHER) + "\n" + json.dumps(TIME) + "\n</tools>" in text  # Qwen's own block
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text
    assert tool_call_format(tokenizer.hf.chat_template) == "hermes"
    assert tool_call_format("{{ '<|python_tag|>' }}") == "llama3_json"


@pytest.mark.parametrize("messages, tools, error", [
    ([{"role": "tool", "content": "18 C"}], [], "role tool and no tool_call_id"),
    ([{"role": "user", "content": "x", "tool_calls": [CALL]}], [], "only an assistant calls tools"),
    ([{"role": "assistant", "content": "", "tool_calls": [CALL | {"function": {"name": "get weather",
                                                                              "arguments": "{}"}}]}], [], "1 to 64"),
    ([{"role": "assistant", "content": "", "tool_calls": [CALL | {"function": {"name": "f", "arguments": "{x"}}]}],
     [], "arguments is not JSON"),
    ([USER], [WEATHER, WEATHER], "a second function named 'get_weather'"),
    ([USER], [{"type": "function", "function": {"name": "f", "parameters": "[1]"}}], "JSON schema object"),
    ([USER], [{"type": "function", "function": {"name": "f", "parameters": "{oops"}}], "parameters is not JSON"),
    ([USER], [TIME] * (MAX_TOOLS + 1), f"at most {MAX_TOOLS}"),
])  # fmt: skip
def test_malformed_tools_and_messages_are_refused_naming_them(messages, tools, error):
    if len(tools) > MAX_TOOLS:
        tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(len(tools))]
    with pytest.raises(ValueError, match=error):
        chat_messages(build_request(messages, tools=tools).chat, 4096)


def _plan(**fields):
    return ChatCompletionRequest(messages=[USER], **fields).tool_plan


def test_tool_choice_decides_what_is_rendered_and_what_is_enforced():
    assert _plan().mode is None and _plan(tools=[WEATHER], tool_choice="none").tools == []
    auto = _plan(tools=[WEATHER])
    assert auto.mode == "auto" and auto.tools == [WEATHER] and auto.structured_outputs is None
    named = _plan(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert (named.mode, named.name) == ("named", "get_weather")
    assert named.structured_outputs == {"json": WEATHER["function"]["parameters"]}
    required = _plan(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    array = required.structured_outputs["json"]
    assert array["minItems"] == 1 and array["maxItems"] == 1
    assert [c["properties"]["name"] for c in array["items"]["anyOf"]] == [{"const": "get_weather"},
                                                                         {"const": "get_time"}]  # fmt: skip
    proto = ChatCompletionRequest(messages=[USER], tools=[WEATHER], tool_choice="required").to_proto("r")
    assert json.loads(proto.sampling.structured_output.json_schema)["type"] == "array"
    assert [t.name for t in proto.chat.tools] == ["get_weather"]


@pytest.mark.parametrize("fields, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                           "minProperties": "x"}}}],
      "tool_choice": "required"}, "tools.0.function.parameters"),
])  # fmt: skip
def test_a_tool_choice_that_cannot_be_served_is_refused_naming_the_field(fields, param):
    with pytest.raises(FieldError) as err:
        ChatCompletionRequest(messages=[USER], **fields).to_proto("r")
    assert err.value.param == param


HERMES = ('I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')  # fmt: skip
# (mode, format, answer, content, [(name, arguments)])
ANSWERS = [
    ("auto", "hermes", HERMES, "I will look.\n", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("auto", "hermes", '\n<tool_call>\n{"name": "get_time", "arguments": {}}', None, [("get_time", {})]),  # unclosed
    ("auto", "hermes", 'No call: <tool_call>{"name": oops}</tool_call> after', 'No call: <tool_call>{"name": oops}'
     '</tool_call> after', []),
    ("auto", "hermes", HERMES.replace('{"name": "get_time"', '{"nam'), "I will look.\n",
     [("get_weather", {"city": "Paris"})]),  # calls up to the first that does not parse
    ("auto", "hermes", "Just text, < and <tool but no call.", "Just text, < and <tool but no call.", []),
    ("auto", "llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
     '{"name": "get_time", "parameters": {}}', None, [("get_weather", {"city": "Rome"}), ("get_time", {})]),
    ("auto", "llama3_json", '{"name": "get_time", "parameters": {}} and then text', '{"name": "get_time", '
     '"parameters": {}} and then text', []),
    ("auto", "llama3_json", "It is sunny {probably}.", "It is sunny {probably}.", []),
    ("required", "hermes", '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', None,
     [("get_weather", {"city": "Oslo"})]),
    ("required", "hermes", '[{"name": "get_weather", "argum', '[{"name": "get_weather", "argum', []),  # cut short
    ("named", "hermes", '{"city": "Lima"}', None, [("get_weather", {"city": "Lima"})]),
]  # fmt: skip


@pytest.mark.parametrize("mode, fmt, answer, content, calls", ANSWERS)
def test_calls_are_read_from_a_whole_answer(mode, fmt, answer, content, calls):
    got_content, got = parse(mode, fmt, answer, name="get_weather")
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert len({c.id for c in got}) == len(got) and all(c.id.startswith("call_") for c in got)


@pytest.mark.parametrize("mode, fmt, answer, content, calls", ANSWERS)
def test_streamed_deltas_add_up_to_the_whole_answers_reading(mode, fmt, answer, content, calls):
    rng = random.Random(7)
    splits = [[1] * len(answer), [3] * len(answer)] + [[rng.randint(1, 12) for _ in answer] for _ in range(20)]
    for sizes in splits:
        stream, at, sent, deltas = ToolCallStream(mode, fmt, "get_weather"), 0, "", []
        for size in sizes:
            if at >= len(answer):
                break
            piece_content, piece_deltas = stream.feed(answer[at: at + size])
            sent, deltas, at = sent + piece_content, deltas + piece_deltas, at + size
        rest, more = stream.finish()
        sent, deltas = sent + rest, deltas + more
        assert sent == (content or "")
        assert "<tool_call>" not in sent or not calls
        assert _joined(deltas) == [(name, args) for name, args in calls]
        assert stream.made_calls == (bool(calls) and mode != "named")


def _joined(deltas: list[dict]) -> list[tuple[str, dict]]:
    """OpenAI's tool-call deltas put together as a client does: by index, the first with id and name, the
    arguments concatenated."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        call = calls.setdefault(delta["index"], {"name": None, "arguments": ""})
        if "id" in delta:
            assert call["name"] is None and delta["id"].startswith("call_") and delta["type"] == "function"
            call["name"] = delta["function"]["name"]
        call["arguments"] += delta["function"].get("arguments", "")
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


def test_a_hermes_calls_arguments_stream_piece_by_piece_and_a_cut_one_as_written():
    stream, pieces = ToolCallStream("auto", "hermes"), []
    for char in HERMES:
        pieces += stream.feed(char)[1]
    weather = [d for d in pieces + stream.finish()[1] if d["index"] == 0]
    assert weather[0]["function"] == {"name": "get_weather", "arguments": ""}  # the name first, alone
    assert len(weather) > 10 and "".join(d["function"]["arguments"] for d in weather) == '{"city": "Paris"}'
    cut = ToolCallStream("auto", "hermes")  # max_tokens ends it inside the arguments
    deltas = cut.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')[1] + cut.finish()[1]
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Par'
    assert parse("auto", "hermes", cut.text) == (cut.text, [])  # whole, it is text: no call is made up


def test_parallel_tool_calls_false_keeps_the_first_call():
    _, calls = parse("auto", "hermes", HERMES, parallel=False)
    assert [c.name for c in calls] == ["get_weather"]
    stream = ToolCallStream("auto", "hermes", parallel=False)
    _, deltas = stream.feed(HERMES)
    assert [d["function"]["name"] for d in deltas + stream.finish()[1]] == ["get_weather"]


def test_the_wire_carries_tools_and_calls_for_grpc_clients():
    request = build_request(TOOL_TURN, tools=[WEATHER])
    assert request.chat.tools[0] == pb.Tool(name="get_weather", description="The weather in a city now",
                                            parameters=json.dumps(WEATHER["function"]["parameters"]))  # fmt: skip
    assert request.chat.messages[1].tool_calls[0] == pb.ToolCall(id="call_1", name="get_weather",
                                                                 arguments='{"city": "Paris"}')  # fmt: skip
    with pytest.raises(ValueError, match="chat messages"):
        build_request("plain text", tools=[WEATHER])
