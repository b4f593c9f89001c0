"""Bad input raises ValueError naming the limit and the value."""

from __future__ import annotations

import json

import pytest

from engine import LLM, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, r"max_tokens must be a positive integer, got 0"),
        ({"max_tokens": -3}, r"max_tokens must be a positive integer, got -3"),
        ({"temperature": -0.5}, r"temperature must be a finite number >= 0 .* got -0.5"),
        ({"temperature": float("nan")}, r"temperature must be a finite number >= 0 .* got nan"),
        ({"temperature": float("inf")}, r"temperature must be a finite number >= 0 .* got inf"),
        ({"temperature": 1e-38}, r"temperature must be 0 \(greedy\) or at least 0.01, got 1e-38"),
        ({"top_p": float("nan")}, r"top_p must be in \(0, 1\], got nan"),
        ({"repetition_penalty": float("nan")}, r"repetition_penalty must be a finite number > 0"),
        ({"repetition_penalty": float("inf")}, r"repetition_penalty must be a finite number > 0"),
        ({"stop_token_ids": [-1]}, r"stop_token_ids must be non-negative integers, got \[-1\]"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_k": -1}, r"top_k must be >= 0"),
        ({"repetition_penalty": 0}, r"repetition_penalty must be a finite number > 0"),
        ({"stop": [""]}, r"stop strings must be non-empty"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt(llm, prompt):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([prompt] if prompt == [] else prompt, SamplingParams(max_tokens=4))


def test_out_of_vocabulary_token_ids(llm):
    with pytest.raises(ValueError, match=r"integers in \[0, 49152\); got \[49152\]"):
        llm.generate([[1, 2, 49152]], SamplingParams(max_tokens=4))


def test_stop_token_ids_outside_the_vocabulary(llm):
    with pytest.raises(ValueError, match=r"stop_token_ids must be integers in \[0, 49152\); got \[1000000000\]"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, stop_token_ids=[2, 10**9]))


def test_smallest_temperature_samples_finite_tokens(llm):
    [out] = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.01, seed=3, max_tokens=4, ignore_eos=True))
    [greedy] = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert out.token_ids == greedy.token_ids  # at 0.01 the logits' gaps dwarf the noise


def test_prompt_longer_than_model_context(llm):
    with pytest.raises(ValueError, match=r"prompt has 9000 tokens but at most 8191 fit \(model context 8192"):
        llm.generate([[1] * 9000], SamplingParams(max_tokens=4))


def test_prompt_longer_than_kv_pool():
    tiny = LLM("default", num_blocks=4, block_size=16)
    with pytest.raises(ValueError, match=r"prompt has 100 tokens but at most 63 fit .*KV pool 64 tokens"):
        tiny.generate([[1] * 100], SamplingParams(max_tokens=4))
    # the engine is still usable and nothing is left queued
    assert not tiny.engine.has_unfinished_requests()
    assert tiny.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].finish_reason == "length"


def test_a_bad_prompt_in_a_batch_queues_nothing(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()


def test_unknown_model_path(tmp_path):
    with pytest.raises(ValueError, match=r"is not a model directory \(no config.json there\)"):
        LLM(str(tmp_path / "nowhere"))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"architecture \['GPT2LMHeadModel'\]; supported: LlamaForCausalLM"):
        LLM(str(tmp_path))


def test_bad_engine_options():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="block_size"):
        LLM("default", block_size=0)
    with pytest.raises(ValueError, match="max_model_len=9000 exceeds the model's context of 8192"):
        LLM("default", max_model_len=9000, num_blocks=8)


def test_tensor_parallel_options_the_engine_cannot_run_are_refused_before_any_rank_starts():
    """The bundled model has 3 KV heads: 4 ranks would leave one without a head. (More ranks than GPUs, and a
    disk tier under ranks on CUDA, are refused on a GPU host.)"""
    with pytest.raises(ValueError, match="tensor_parallel_size 4 is more than this model's 3 KV heads"):
        LLM("default", tensor_parallel_size=4, num_blocks=8)
