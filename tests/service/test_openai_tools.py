"""Tool calling through the router's HTTP door, on the bundled model, with the openai SDK as the client: a call
forced by ``tool_choice`` (required, a named function) always parses against its function's schema; a call the
model writes itself (``auto``, Hermes format) comes back as ``tool_calls``, streamed or whole; a call, its
result and the final answer round-trip, the model seeing both; gRPC renders the same prompt; and what cannot
be served is 400 naming the field."""

from __future__ import annotations

import json

import grpc
import jsonschema
import openai
import pytest
from pydantic import BaseModel
from router_utils import http_stack, openai_client, post_json

from kvserve.client import Client

MODEL = "SmolLM2-135M-Instruct"
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "unit": {"type": "string", "enum": ["C", "F"]}},
          "required": ["city", "unit"], "additionalProperties": False}  # fmt: skip
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                            "parameters": PARAMS}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
USER = {"role": "user", "content": "What is the weather in Paris?"}
# Forces a Hermes call in the model's own text, so that auto's reading is tested on a known answer
HERMES_CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": '
               r'\{"city": "(Paris|Rome)", "unit": "C"\}\}\n</tool_call>')


class GetWeather(BaseModel):
    city: str
    unit: str


@pytest.fixture(scope="module")
def stack(model_dir):
    with http_stack(model_dir, [MODEL], num_blocks=96) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai_client(stack)


def _create(client, **fields):
    return client.chat.completions.create(model=MODEL, **({"messages": [USER], "max_tokens": 64, "temperature": 0}
                                                           | fields))  # fmt: skip


def test_required_calls_parse_against_the_schema_and_a_call_round_trips(client, stack):
    for temperature, seed in ((0, None), (1.0, 5)):
        reply = _create(client, tools=[WEATHER, TIME], tool_choice="required", temperature=temperature, seed=seed)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            if call.function.name == "get_weather":
                jsonschema.validate(json.loads(call.function.arguments), PARAMS)
            else:
                assert call.function.name == "get_time" and json.loads(call.function.arguments) == {}
    call = choice.message.tool_calls[0]
    conversation = [USER, choice.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]  # fmt: skip
    final = _create(client, messages=conversation, tools=[WEATHER, TIME], tool_choice="none", max_tokens=16)
    assert final.choices[0].message.tool_calls is None and final.choices[0].message.content
    # What the model saw: the call it made, in its format, and the result
    status, seen = post_json(stack, "/tokenize", {"model": MODEL, "messages": conversation})
    assert status == 200 and seen["count"] == final.usage.prompt_tokens
    _, text = post_json(stack, "/detokenize", {"model": MODEL, "tokens": seen["tokens"]})
    assert f'{{"name": "{call.function.name}", "arguments": {call.function.arguments}}}' in text["prompt"]
    assert "<|im_start|>tool\n18 degrees, sunny<|im_end|>" in text["prompt"]


def test_a_named_function_streams_its_arguments_as_the_whole_answer_has_them(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = _create(client, tools=[WEATHER, TIME], tool_choice=choice).choices[0]
    assert whole.finish_reason == "stop" and whole.message.tool_calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(whole.message.tool_calls[0].function.arguments), PARAMS)
    deltas, finish_reasons = [], []
    for chunk in _create(client, tools=[WEATHER, TIME], tool_choice=choice, stream=True):
        deltas += chunk.choices[0].delta.tool_calls or []
        finish_reasons.append(chunk.choices[0].finish_reason)
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert all(d.index == 0 and d.id is None for d in deltas[1:]) and len(deltas) > 3  # piece by piece
    assert "".join(d.function.arguments for d in deltas) == whole.message.tool_calls[0].function.arguments
    assert finish_reasons[-1] == "stop"
    parsed = client.chat.completions.parse(model=MODEL, messages=[USER], max_tokens=64, temperature=0,
                                           tools=[openai.pydantic_function_tool(GetWeather)],
                                           tool_choice={"type": "function", "function": {"name": "GetWeather"}})
    assert isinstance(parsed.choices[0].message.tool_calls[0].function.parsed_arguments, GetWeather)


def test_auto_reads_a_call_the_model_writes_streamed_or_whole(client):
    fields = {"tools": [WEATHER, TIME], "extra_body": {"structured_outputs": {"regex": HERMES_CALL}}}
    whole = _create(client, **fields).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    [call] = whole.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    deltas, content = [], ""
    for chunk in _create(client, stream=True, **fields):
        deltas += chunk.choices[0].delta.tool_calls or []
        content += chunk.choices[0].delta.content or ""
        finish_reason = chunk.choices[0].finish_reason
    assert content == "" and finish_reason == "tool_calls"
    assert deltas[0].id.startswith("call_") and (deltas[0].function.name, deltas[0].function.arguments) == (
        "get_weather", "")  # the name first, then the arguments piece by piece
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:]) and len(deltas) > 3
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments


def test_grpc_renders_the_same_tools_and_auto_reads_its_text(client, stack):
    reply = _create(client, tools=[WEATHER], max_tokens=24)
    with Client(stack.address) as grpc_client:
        result = grpc_client.generate([USER], tools=[WEATHER], max_tokens=24, temperature=0)
    assert result.usage["prompt_tokens"] == reply.usage.prompt_tokens  # the same rendering, tools listed
    message = reply.choices[0].message
    if "<tool_call>" in result.text:  # the model chose to call: auto read it
        assert message.tool_calls and message.tool_calls[0].function.name == "get_weather"
    else:
        assert message.content == result.text and message.tool_calls is None
    plain = _create(client, max_tokens=24)
    assert plain.usage.prompt_tokens < reply.usage.prompt_tokens  # without tools none are listed


@pytest.mark.parametrize("fields, param, message", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "not among the tools"),
    ({"messages": [USER, {"role": "tool", "content": "18 C"}]}, "messages.1.tool_call_id", "no tool_call_id"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, None, "1 to 64"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
])  # fmt: skip
def test_what_cannot_be_served_is_400_naming_it(stack, fields, param, message):
    status, reply = post_json(stack, "/v1/chat/completions", {"model": MODEL, "messages": [USER], **fields})
    assert status == 400 and message in reply["error"]["message"], reply
    assert reply["error"]["param"] == param


def test_grpc_refuses_a_tool_message_without_its_call(stack):
    with Client(stack.address) as grpc_client, pytest.raises(grpc.RpcError) as err:
        grpc_client.generate([USER, {"role": "tool", "content": "18 C"}], max_tokens=4)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tool_call_id" in err.value.details()
