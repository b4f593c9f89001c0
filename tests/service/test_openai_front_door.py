"""What real OpenAI clients expect of the HTTP API, over real HTTP against a router and a decode worker that
serve a 96-token context (``--max-model-len``): a chat without max_tokens runs to the end of the context; OpenAI
fields kvserve does not implement get 400 naming them, unknown fields are ignored; developer and tool messages
are served; vLLM's /tokenize and /detokenize agree with the tokenizer; /v1/models reports the root and context,
and an unknown model is 404 ``model_not_found``."""

from __future__ import annotations

import openai
import pytest
from router_utils import http_stack, openai_client, post_json

from engine.tokenizer import Tokenizer
from rpc.validation import encode_chat

MODEL, ALIAS, ROOT = "SmolLM2-135M-Instruct", "smol", "/models/SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 96
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
PROMPT = "The three most useful things to know about Paris are"


@pytest.fixture(scope="module")
def stack(model_dir):
    with http_stack(model_dir, [MODEL, ALIAS], root=ROOT, num_blocks=16, max_model_len=MAX_MODEL_LEN) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai_client(stack)



def test_a_chat_without_max_tokens_runs_to_the_end_of_the_context(client):
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, extra_body={"ignore_eos": True})
    usage = reply.usage
    assert usage.completion_tokens == MAX_MODEL_LEN - usage.prompt_tokens > 16  # the worker takes exactly the rest
    assert reply.choices[0].finish_reason == "length"
    completion = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 16  # completions keep OpenAI's default


@pytest.mark.parametrize("path, field, value", [
    ("/v1/chat/completions", "functions", [{"name": "get_weather"}]),
    ("/v1/completions", "suffix", "!"),
])  # fmt: skip
def test_an_unimplemented_field_is_400_naming_it(stack, path, field, value):
    prompt = {"messages": CHAT} if "chat" in path else {"prompt": PROMPT}
    status, reply = post_json(stack, path, {"model": MODEL, **prompt, "max_tokens": 2, field: value})
    assert status == 400
    assert reply["error"]["param"] == field and reply["error"]["type"] == "invalid_request_error"
    assert reply["error"]["message"].startswith(f"{field}=")


def test_explicit_defaults_harmless_and_unknown_fields_are_served(client):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=2,
        n=1,
        logprobs=False,
        presence_penalty=0,
        frequency_penalty=0,
        user="u-1",
        metadata={"k": "v"},
        store=False,
        extra_body={"min_p": 0.1, "chat_template_kwargs": {"enable_thinking": False}, "some_vendor_extra": 1},
    )
    assert reply.usage.completion_tokens == 2
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, echo=False, best_of=1, n=1)
    assert completion.usage.completion_tokens == 2


def test_developer_and_tool_messages_are_served(client):
    messages = [{"role": "developer", "content": "Answer in one word."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]  # fmt: skip
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert reply.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, max_tokens=2, messages=[*messages[:3], {"role": "tool", "content": "18 C"}]
        )
    assert err.value.body["param"] == "messages.3.tool_call_id"


def test_tokenize_and_detokenize_agree_with_the_tokenizer(stack, client, model_dir):
    tokenizer = Tokenizer(model_dir)
    status, reply = post_json(stack, "/tokenize", {"model": MODEL, "prompt": PROMPT, "add_special_tokens": True})
    assert status == 200
    assert reply["tokens"] == tokenizer.encode(PROMPT) and reply["count"] == len(reply["tokens"])
    assert reply["max_model_len"] == MAX_MODEL_LEN
    assert post_json(stack, "/detokenize", {"model": MODEL, "tokens": reply["tokens"]}) == (200, {"prompt": PROMPT})
    status, chat = post_json(stack, "/tokenize", {"model": MODEL, "messages": CHAT, "add_generation_prompt": True})
    assert chat["tokens"] == encode_chat(tokenizer, CHAT)
    usage = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens  # what a chat request's prompt is
    assert post_json(stack, "/detokenize", {"model": MODEL, "tokens": [1 << 30]})[1]["error"]["param"] == "tokens"


def test_models_report_root_and_context_and_an_unknown_model_is_404(stack, client):
    cards = client.models.list().data
    assert [c.id for c in cards] == [MODEL, ALIAS]
    assert all(c.root == ROOT and c.max_model_len == MAX_MODEL_LEN for c in cards)
    assert client.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=1).model == ALIAS
    status, reply = post_json(stack, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
    assert status == 200 and reply["model"] == MODEL  # no model: the default
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=1)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    assert post_json(stack, "/tokenize", {"model": "gpt-4o", "prompt": "x"})[0] == 404
