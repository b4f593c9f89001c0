"""Log-probabilities and the sampling set over the OpenAI HTTP API and gRPC, against transformers: completions'
``logprobs`` with ``echo`` (lm-evaluation-harness's request), chat's ``logprobs``/``top_logprobs``, streamed
chunks adding up to the whole answer, ``logit_bias`` and ``min_tokens`` reaching the sampler, and bad values
refused with 400 naming the field."""

from __future__ import annotations

import pytest
import torch
from router_utils import http_stack, openai_client, post_json

from kvserve.client import Client

MODEL = "SmolLM2-135M-Instruct"
TOLERANCE = 1e-4  # fp32 on both sides, different schedules (tests/engine/test_logprobs.py)
PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def stack(model_dir):
    with http_stack(model_dir, [MODEL], num_blocks=64) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai_client(stack)



def _hf(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_completions_echo_with_logprobs_is_what_lm_eval_reads(client, hf_model, tokenizer):
    ids = tokenizer.encode(PROMPT)
    reply = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, echo=True, logprobs=2)
    choice = reply.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 3 == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first prompt token has none
    expected = _hf(hf_model, ids)
    for p in range(1, len(ids)):
        assert abs(lp.token_logprobs[p] - float(expected[p - 1, ids[p]])) < TOLERANCE
        assert lp.tokens[p] == tokenizer.decode([ids[p]], skip_special_tokens=False)
    generated = expected[-1].argmax().item()  # greedy: the first new token is the model's most likely
    assert lp.tokens[len(ids)] == tokenizer.decode([generated], skip_special_tokens=False)
    assert abs(lp.token_logprobs[len(ids)] - float(expected[-1, generated])) < TOLERANCE
    for p in range(1, len(lp.tokens)):
        top = lp.top_logprobs[p]
        assert len(top) <= 2 and max(top.values()) >= lp.token_logprobs[p] - TOLERANCE
    assert choice.text.startswith(tokenizer.decode(ids)) and lp.text_offset[0] == 0
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_streamed_logprobs_add_up_to_the_whole_answer(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                      echo=True)  # fmt: skip
    tokens, values, offsets, text = [], [], [], ""
    for event in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                           echo=True, stream=True):  # fmt: skip
        choice = event.choices[0]
        text += choice.text
        if choice.logprobs is not None:
            tokens += choice.logprobs.tokens
            values += choice.logprobs.token_logprobs
            offsets += choice.logprobs.text_offset
    whole_lp = whole.choices[0].logprobs
    assert text == whole.choices[0].text and (tokens, offsets) == (whole_lp.tokens, whole_lp.text_offset)
    assert values[0] is None is whole_lp.token_logprobs[0]  # (two requests: their values within the tolerance)
    assert values[1:] == pytest.approx(whole_lp.token_logprobs[1:], abs=TOLERANCE)


def test_chat_logprobs_equal_transformers(client, hf_model, tokenizer):
    messages = [{"role": "user", "content": "Name a colour."}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                           logprobs=True, top_logprobs=3)  # fmt: skip
    content = reply.choices[0].logprobs.content
    ids = tokenizer.encode_chat(messages)
    for entry in content:
        expected = _hf(hf_model, ids)[-1]
        token = int(expected.argmax())
        assert entry.token == tokenizer.decode([token], skip_special_tokens=False)
        assert entry.bytes == list(entry.token.encode())
        assert abs(entry.logprob - float(expected[token])) < TOLERANCE
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(expected.topk(3).values.tolist(), abs=TOLERANCE)
        ids.append(token)
    assert len(content) == reply.usage.completion_tokens == 5


def test_grpc_client_gets_logprobs_and_prompt_logprobs(stack, hf_model, tokenizer):
    ids = tokenizer.encode(PROMPT)
    with Client(stack.address) as grpc_client:
        result = grpc_client.generate(ids, max_tokens=2, temperature=0, logprobs=1, prompt_logprobs=0)
    expected = _hf(hf_model, ids + result.token_ids)
    assert result.prompt_token_ids == ids and len(result.prompt_logprobs) == len(ids) - 1
    for p, entry in enumerate(result.prompt_logprobs, start=1):
        assert entry.token_id == ids[p] and abs(entry.logprob - float(expected[p - 1, ids[p]])) < TOLERANCE
        assert entry.top == []
    for j, entry in enumerate(result.logprobs):
        assert entry.token_id == result.token_ids[j] and len(entry.top) == 1
        assert abs(entry.logprob - float(expected[len(ids) - 1 + j, entry.token_id])) < TOLERANCE


def test_logit_bias_and_min_tokens_reach_the_sampler(client, tokenizer):
    forced = tokenizer.encode(" banana", add_special_tokens=False)[0]
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                      logit_bias={str(forced): 100})  # fmt: skip
    assert reply.choices[0].text == tokenizer.decode([forced] * 4)
    eos = tokenizer.eos_token_id
    held = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
                                     logit_bias={str(eos): 100}, extra_body={"min_tokens": 3})  # fmt: skip
    assert held.usage.completion_tokens == 4 and held.choices[0].finish_reason == "stop"  # 3 held back, then EOS


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": PROMPT, "logprobs": 21}, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"prompt": PROMPT, "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": PROMPT, "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": PROMPT, "logit_bias": {"999999": 1}}, "logit_bias"),
    ({"prompt": PROMPT, "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": PROMPT, "min_p": 1.5}, "min_p"),
])  # fmt: skip
def test_bad_values_are_refused_naming_the_field(stack, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    status, reply = post_json(stack, path, {"model": MODEL, "max_tokens": 2, **body})
    assert status == 400, reply
    assert param in reply["error"]["message"], reply


def test_max_tokens_zero_with_echo_scores_the_prompt_and_generates_nothing(client, hf_model, tokenizer):
    ids = tokenizer.encode(PROMPT)
    reply = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=0, temperature=0)
    lp = reply.choices[0].logprobs
    assert reply.usage.completion_tokens == 0 and reply.choices[0].finish_reason == "length"
    assert reply.choices[0].text == tokenizer.decode(ids) and len(lp.tokens) == len(ids)
    expected = _hf(hf_model, ids)
    assert all(abs(lp.token_logprobs[p] - float(expected[p - 1, ids[p]])) < TOLERANCE for p in range(1, len(ids)))
