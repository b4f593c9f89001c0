"""Log-probabilities against transformers' own ``log_softmax`` of its logits, for generated and prompt tokens,
with prefix caching on and off, under chunking, preemption and speculative decoding; ``max_tokens=0``."""

from __future__ import annotations

import pytest
import torch
from engine_testing import BLOCK_SIZE

from engine import LLM, SamplingParams

# fp32 on both sides, two schedules of the same arithmetic (a whole prompt against chunks and a paged cache):
# the log-softmax of the 30-layer model differs by summation order only, measured at most ~2e-5 here.
TOLERANCE = 1e-4
K = 5


def hf_logprobs(hf_model, tokens: list[int]) -> torch.Tensor:
    """``(len(tokens), vocab)``: row p is transformers' log-distribution of the token after position p."""
    with torch.inference_mode():
        return hf_model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)


def check(entry, expected_row: torch.Tensor, token: int, k: int = K) -> None:
    assert entry.token_id == token
    assert abs(entry.logprob - float(expected_row[token])) < TOLERANCE, (entry.logprob, float(expected_row[token]))
    assert len(entry.top) == k
    want = expected_row.topk(k)
    assert [lp for _, lp in entry.top] == pytest.approx(want.values.tolist(), abs=TOLERANCE)
    # the alternatives are the most likely tokens (ids compared where their values are not near-ties)
    for (tok, lp), want_tok in zip(entry.top, want.indices.tolist(), strict=True):
        assert tok == want_tok or abs(float(expected_row[want_tok]) - lp) < TOLERANCE


@pytest.mark.parametrize("caching", [True, False])
def test_generated_and_prompt_logprobs_equal_transformers(hf_model, engine_prompts, caching):
    llm = LLM("default", block_size=BLOCK_SIZE, num_blocks=256, enable_prefix_caching=caching,
              max_num_batched_tokens=64)  # fmt: skip
    prompts = [engine_prompts[i] for i in (0, 3, 6)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=K, prompt_logprobs=K)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2))  # warm the prefix cache, when on
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        expected = hf_logprobs(hf_model, prompt + out.token_ids)
        assert len(out.logprobs) == len(out.token_ids) == 6
        for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            check(entry, expected[len(prompt) - 1 + j], token)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for p in range(1, len(prompt)):
            check(out.prompt_logprobs[p], expected[p - 1], prompt[p])
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_logprobs_come_from_the_raw_distribution_whatever_was_drawn(hf_model, engine_prompts):
    """A sampled, penalized, biased request reports the model's own log-probabilities of what it drew."""
    llm = LLM("default", block_size=BLOCK_SIZE, num_blocks=128)
    prompt = engine_prompts[4]
    params = SamplingParams(temperature=1.3, top_k=40, seed=3, max_tokens=8, ignore_eos=True, logprobs=0,
                            repetition_penalty=1.2, presence_penalty=0.5, logit_bias={13: 5.0})  # fmt: skip
    [out] = llm.generate([prompt], params)
    expected = hf_logprobs(hf_model, prompt + out.token_ids)
    for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        check(entry, expected[len(prompt) - 1 + j], token, k=0)


def test_speculative_decoding_gives_the_same_logprobs(engine_prompts):
    prompt = engine_prompts[6][:40] * 3  # repeats, so n-gram proposals get accepted
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    plain = LLM("default", block_size=BLOCK_SIZE, num_blocks=128)
    spec = LLM("default", block_size=BLOCK_SIZE, num_blocks=128,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4})  # fmt: skip
    [a], [b] = plain.generate([prompt], params), spec.generate([prompt], params)
    assert spec.engine.speculator.stats.num_accepted > 0
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < TOLERANCE
        assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_max_tokens_zero_scores_the_prompt_only(hf_model, engine_prompts):
    llm = LLM("default", block_size=BLOCK_SIZE, num_blocks=64)
    prompt = engine_prompts[2]
    [out] = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=1))
    assert out.token_ids == [] and out.finish_reason == "length"
    expected = hf_logprobs(hf_model, prompt)
    for p in range(1, len(prompt)):
        check(out.prompt_logprobs[p], expected[p - 1], prompt[p], k=1)
    assert llm.engine.block_manager.num_free_blocks == 64
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(max_tokens=0)
