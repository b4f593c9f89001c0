"""The HTTP API's request bodies (``router.openai_protocol``, ``router.openai_fields``): OpenAI's fields kvserve
does not implement are refused, naming the field, unless their value asks for nothing; harmless ones and
unknown ones are accepted (an unknown one logged once); chat messages of the developer and tool roles and
assistant tool calls go on the wire (their rendering: tests/unit/test_tool_calls.py); a chat without max_tokens
may fill the context."""

from __future__ import annotations

import logging

import pytest

from protos.kvserve.v1 import kvserve_pb2 as pb
from router import openai_fields
from router.openai_fields import UNSERVED, FieldError
from router.openai_protocol import ChatCompletionRequest, CompletionRequest
from rpc.validation import validate_sampling

USER = {"role": "user", "content": "Weather in Paris?"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOL_TURN = [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
             {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]  # fmt: skip


def _completion(**fields) -> CompletionRequest:
    return CompletionRequest(prompt="hi", **fields)


def _chat(messages=(USER,), **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=list(messages), **fields)


@pytest.mark.parametrize("fields", [
    {"n": 1}, {"best_of": 1}, {"echo": False}, {"suffix": ""}, {"logprobs": False}, {"logprobs": None},
    {"top_logprobs": 0}, {"presence_penalty": 0}, {"frequency_penalty": 0.0}, {"logit_bias": {}},
    {"response_format": {"type": "text"}}, {"functions": []}, {"function_call": "none"}, {"modalities": ["text"]},
    {"audio": None}, {"verbosity": "medium"},
    {"user": "u-1", "metadata": {"k": "v"}, "store": True, "service_tier": "flex", "prompt_cache_key": "k"},
])  # fmt: skip
def test_values_that_ask_for_nothing_are_accepted(fields):
    _completion(**fields).check_fields()
    _chat(**fields).check_fields()


@pytest.mark.parametrize("name, value", [
    ("suffix", "!"),
    ("functions", [{"name": "f"}]), ("function_call", {"name": "f"}), ("audio", {"voice": "alloy"}),
    ("modalities", ["text", "audio"]), ("prediction", {"type": "content", "content": "x"}),
    ("reasoning_effort", "low"), ("verbosity", "high"), ("web_search_options", {}),
])  # fmt: skip
def test_unimplemented_behaviour_is_refused_naming_the_field(name, value):
    assert name in UNSERVED
    for body in (_completion(**{name: value}), _chat(**{name: value})):
        with pytest.raises(FieldError, match=f"^{name}=") as err:
            body.check_fields()
        assert err.value.param == name


def test_n_and_a_list_of_prompts_make_one_request_per_prompt_and_best_of_must_be_n():
    protos = CompletionRequest(prompt=[[1, 2], [3]], n=3, best_of=3).to_protos("cmpl-1")
    assert [p.request_id for p in protos] == ["cmpl-1-0", "cmpl-1-1"]
    assert [list(p.token_ids.ids) for p in protos] == [[1, 2], [3]] and protos[0].sampling.n == 3
    assert not _completion().to_protos("r")[0].sampling.HasField("n")
    for body in (_completion(n=2, best_of=3), _completion(best_of=2)):
        with pytest.raises(FieldError, match="^best_of=") as err:
            body.to_protos("r")
        assert err.value.param == "best_of"
    with pytest.raises(FieldError, match="empty list") as err:
        CompletionRequest(prompt=[]).to_protos("r")
    assert err.value.param == "prompt"


def test_an_unknown_field_is_ignored_and_logged_once(caplog, monkeypatch):
    monkeypatch.setattr(openai_fields, "_logged_names", set())
    with caplog.at_level(logging.WARNING, logger="router.openai_fields"):
        for _ in range(3):
            _chat(truncate_prompt_tokens=10, guided_json={"type": "object"}, top_k=5, min_p=0.1).check_fields()
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2 and "'truncate_prompt_tokens'" in logged[0] and "'guided_json'" in logged[1]  # (served)


def test_the_set_of_logged_names_is_bounded(monkeypatch):
    monkeypatch.setattr(openai_fields, "_logged_names", set())
    _completion(**{f"x{i}": 1 for i in range(openai_fields.MAX_LOGGED_NAMES + 10)}).check_fields()
    assert len(openai_fields._logged_names) == openai_fields.MAX_LOGGED_NAMES


def test_developer_is_system_and_tool_messages_go_on_the_wire():
    messages = _chat([{"role": "developer", "content": "Be brief."}, *TOOL_TURN]).to_proto("r").chat.messages
    assert [(m.role, m.content) for m in messages] == [("system", "Be brief."), ("user", USER["content"]),
                                                        ("assistant", ""), ("tool", "18 C, sunny")]  # fmt: skip
    assert [(c.id, c.name, c.arguments) for c in messages[2].tool_calls] == [("call_1", "get_weather",
                                                                             '{"city": "Paris"}')]  # fmt: skip
    assert messages[3].tool_call_id == "call_1" and not messages[1].tool_calls


@pytest.mark.parametrize("messages, param", [
    ([USER, {"role": "tool", "content": "18 C"}], "messages.1.tool_call_id"),
    ([{"role": "user", "content": None}], "messages.0.content"),
    ([{"role": "assistant"}], "messages.0.content"),  # no content and no tool calls
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages.0.content"),
    ([], "messages"),
])  # fmt: skip
def test_bad_messages_are_refused_naming_the_field(messages, param):
    with pytest.raises(FieldError) as err:
        _chat(messages).to_proto("r")
    assert err.value.param == param


def test_an_unset_max_tokens_fills_the_context_for_chat_only():
    opts = pb.SamplingOptions()
    assert validate_sampling(opts, 1000, num_prompt_tokens=30, max_context=100, fill_context=True).max_tokens == 70
    assert validate_sampling(opts, 1000, num_prompt_tokens=30, max_context=100).max_tokens == 16
    assert validate_sampling(opts, 1000, num_prompt_tokens=90, max_context=100).max_tokens == 10
    opts.max_tokens = 70  # exactly the rest of the context: accepted
    assert validate_sampling(opts, 1000, num_prompt_tokens=30, max_context=100).max_tokens == 70
    opts.max_tokens = 71
    with pytest.raises(ValueError, match="ask for at most 70 new tokens"):
        validate_sampling(opts, 1000, num_prompt_tokens=30, max_context=100)
