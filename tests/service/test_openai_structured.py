"""Structured outputs through the router's two doors: the openai SDK's ``parse`` with a pydantic model
(``response_format`` json_schema) returns a parsed object, vLLM's ``structured_outputs`` over HTTP and gRPC,
and a bad schema or regex is 400 / INVALID_ARGUMENT naming it."""

from __future__ import annotations

import json
import re

import grpc
import pytest
from pydantic import BaseModel, Field
from router_utils import http_stack, openai_client, post_json

from kvserve.client import Client

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Name a city and how many people live there, as JSON."}]


class City(BaseModel):
    name: str = Field(max_length=16)
    population: int = Field(ge=0, le=100_000_000)


@pytest.fixture(scope="module")
def stack(model_dir):
    with http_stack(model_dir, [MODEL], num_blocks=64) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai_client(stack)



def test_parse_with_a_pydantic_model_returns_the_parsed_object(client):
    for temperature, seed in ((0, None), (1.0, 3)):
        reply = client.chat.completions.parse(model=MODEL, messages=CHAT, response_format=City, max_tokens=64,
                                              temperature=temperature, seed=seed)  # fmt: skip
        choice = reply.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, City)
        assert City.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_and_vllm_structured_outputs_over_http(client):
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=96, temperature=0,
                                           response_format={"type": "json_object"})  # fmt: skip
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    choices = ["Paris", "Rome", "Lisbon"]
    completion = client.completions.create(model=MODEL, prompt="The capital of Italy is", max_tokens=8, seed=1,
                                           temperature=1.0, extra_body={"structured_outputs": {"choice": choices}})
    assert completion.choices[0].text in choices and completion.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=MODEL, prompt="A year:", max_tokens=8, temperature=0, stream=True,
                                       extra_body={"structured_outputs": {"regex": "(19|20)[0-9]{2}"}})  # fmt: skip
    assert re.fullmatch("(19|20)[0-9]{2}", "".join(chunk.choices[0].text for chunk in stream if chunk.choices))


def test_structured_outputs_over_grpc(stack):
    with Client(stack.address) as grpc_client:
        result = grpc_client.generate("A year:", max_tokens=8, temperature=0,
                                      structured_outputs={"regex": "(19|20)[0-9]{2}"})  # fmt: skip
        assert re.fullmatch("(19|20)[0-9]{2}", result.text) and result.finish_reason == "stop"
        with pytest.raises(grpc.RpcError) as err:
            grpc_client.generate("A year:", max_tokens=8, structured_outputs={"regex": "(19"})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "invalid regex" in err.value.details()


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     None, "invalid JSON schema: .*objekt"),
    ({"structured_outputs": {"regex": "[a-"}}, None, "invalid regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type must be"),
])  # fmt: skip
def test_a_bad_structured_output_is_400_naming_it(stack, body, param, message):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, **body}
    status, reply = post_json(stack, "/v1/chat/completions", body)
    assert status == 400 and reply["error"]["type"] == "invalid_request_error"
    assert re.search(message, reply["error"]["message"]), reply
    if param is not None:
        assert reply["error"]["param"] == param
