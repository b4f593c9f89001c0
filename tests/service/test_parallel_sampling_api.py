"""``n`` choices and lists of prompts through the router and a decode worker: the gRPC client's results per
choice, the OpenAI API's choices in OpenAI's order (prompt i, sample j -> index i*n + j), streamed chunks
carrying their choice's index, usage counting each prompt once, and bad values refused with 400."""

from __future__ import annotations

import pytest
from router_utils import http_stack, openai_client, post_json

from kvserve.client import Client, Result

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "One, two, three,"]


@pytest.fixture(scope="module")
def stack(model_dir):
    with http_stack(model_dir, [MODEL], num_blocks=64) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai_client(stack)



def test_grpc_client_gets_one_result_per_choice(stack):
    with Client(stack.address) as grpc_client:
        alone = grpc_client.generate(PROMPTS[0], max_tokens=5, temperature=0, ignore_eos=True)
        assert isinstance(alone, Result)
        results = grpc_client.generate(PROMPTS[0], max_tokens=5, temperature=0, ignore_eos=True, n=3)
        assert [r.token_ids for r in results] == [alone.token_ids] * 3
        assert all(r.finish_reason == "length" for r in results)
        usage = results[0].usage
        assert usage["prompt_tokens"] == alone.usage["prompt_tokens"] and usage["completion_tokens"] == 15
        chunks = list(grpc_client.stream(PROMPTS[0], max_tokens=5, temperature=1.0, seed=5, ignore_eos=True, n=2))
        assert {c.index for c in chunks} == {0, 1}
        assert [c.index for c in chunks if c.finish_reason] in ([0, 1], [1, 0])
        assert [bool(c.usage) for c in chunks] == [False] * (len(chunks) - 1) + [True]  # the stream's last only
        seeded = grpc_client.generate(PROMPTS[0], max_tokens=5, temperature=1.0, seed=6, ignore_eos=True)
        assert seeded.token_ids == [t for c in chunks if c.index == 1 for t in c.token_ids]  # choice 1: seed + 1


def test_n_choices_over_http(client):
    reply = client.completions.create(model=MODEL, prompt=PROMPTS[0], n=3, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.text for c in reply.choices}) == 1 and all(c.finish_reason == "length" for c in reply.choices)
    assert reply.usage.completion_tokens == 12 and reply.usage.total_tokens == reply.usage.prompt_tokens + 12
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                          max_tokens=4, temperature=0.8, seed=3)  # fmt: skip
    assert [c.index for c in chat.choices] == [0, 1] and all(c.message.role == "assistant" for c in chat.choices)


def test_a_list_of_prompts_gives_choices_in_openais_order(client):
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0).choices[0].text
               for p in PROMPTS]  # fmt: skip
    reply = client.completions.create(model=MODEL, prompt=PROMPTS, n=2, max_tokens=5, temperature=0)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text for c in reply.choices] == [singles[0], singles[0], singles[1], singles[1]]
    one = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0)
    assert reply.usage.prompt_tokens > one.usage.prompt_tokens  # each prompt counted once


def test_streamed_chunks_carry_their_choice_index(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPTS, n=2, max_tokens=5, temperature=0)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS, n=2, max_tokens=5, temperature=0, stream=True,
                                       stream_options={"include_usage": True})  # fmt: skip
    texts, finished, usage = {}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            finished[c.index] = c.finish_reason or finished.get(c.index)
    assert [texts[i] for i in range(4)] == [c.text for c in whole.choices]
    assert set(finished.values()) <= {"length", "stop"} and len(finished) == 4
    assert usage.completion_tokens == whole.usage.completion_tokens
    roles = []
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                          max_tokens=3, temperature=0, stream=True)  # fmt: skip
    for chunk in chat:
        roles += [(c.index, c.delta.role) for c in chunk.choices if c.delta.role]
    assert sorted(roles) == [(0, "assistant"), (1, "assistant")]


def test_echo_with_logprobs_gives_every_choice_its_prompt(client):
    reply = client.completions.create(model=MODEL, prompt=PROMPTS[0], n=2, max_tokens=2, temperature=0, echo=True,
                                      logprobs=1)  # fmt: skip
    a, b = reply.choices
    assert a.text == b.text and a.text.startswith(PROMPTS[0])
    assert a.logprobs.tokens == b.logprobs.tokens and a.logprobs.token_logprobs[0] is None
    assert len(a.logprobs.tokens) == reply.usage.prompt_tokens + 2


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "hi", "n": 17}, None, "n must be an integer in [1, 16]"),
    ({"prompt": []}, "prompt", "prompt is an empty list"),
    ({"prompt": "hi", "n": 2, "best_of": 3}, "best_of", "best_of=3"),
])  # fmt: skip
def test_bad_n_empty_list_and_best_of_are_400(stack, body, param, words):
    status, reply = post_json(stack, "/v1/completions", {"model": MODEL, "max_tokens": 2, **body})
    assert status == 400 and words in reply["error"]["message"]
    assert reply["error"]["param"] == param
