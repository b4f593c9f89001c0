"""Tensor parallelism on the CPU (gloo, two rank processes): the bundled model split 2 + 1 KV heads gives one
device's greedy tokens in mixed batches (chunked prefills beside decodes), within a stated logprob tolerance
(``tensor_parallel_testing``); a rank that does not join fails the start within the timeout, and a rank killed
fails the next step instead of hanging it. (Qwen3, Gemma 3, Phi-3 and Qwen3-MoE: ``test_architectures``.)"""

from __future__ import annotations

import time

import pytest
from tensor_parallel_testing import assert_same_greedy

from engine import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def split():
    llm = LLM("default", tensor_parallel_size=2, num_blocks=96, max_num_batched_tokens=40)
    yield llm
    llm.engine.close()


def test_two_ranks_give_one_devices_greedy_tokens_in_mixed_batches(split, engine_prompts):
    runner = split.engine.runner
    assert runner.kv_spec.num_kv_heads == 2 and runner.model.part.config.num_heads == 6  # rank 0: 2 of 3 KV heads
    prompts = [engine_prompts[i][:n] for i, n in ((0, 7), (1, 30), (2, 55), (3, 18))]  # prefills in 40-token chunks
    one = LLM("default", num_blocks=96, max_num_batched_tokens=40)
    single = one.generate(prompts, PARAMS)
    ties = assert_same_greedy(single, split.generate(prompts, PARAMS))
    assert not ties, ties  # (none on these prompts; a tie would be reported, not failed)
    # and again from the prefix cache, whose blocks every rank holds its heads of
    again, want = split.generate(prompts[1:3], PARAMS), one.generate(prompts[1:3], PARAMS)
    assert [o.num_cached_tokens for o in again] == [o.num_cached_tokens for o in want] and again[1].num_cached_tokens
    assert [o.token_ids for o in again] == [o.token_ids for o in single[1:3]]


def test_a_rank_that_does_not_join_in_time_fails_the_start_naming_the_timeout():
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="tensor_parallel_timeout_s"):
        LLM("default", tensor_parallel_size=2, num_blocks=16, tensor_parallel_timeout_s=0.05)  # (a rank takes ~2 s)
    assert time.monotonic() - began < 30


def test_a_killed_rank_fails_the_next_step_instead_of_hanging_it(engine_prompts):
    llm = LLM("default", tensor_parallel_size=2, num_blocks=16, tensor_parallel_timeout_s=20)
    [rank] = llm.engine.runner.ranks._processes
    rank.kill()
    rank.wait()
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="rank process"):
        llm.generate([engine_prompts[0][:8]], PARAMS)
    assert time.monotonic() - began < 25
    llm.engine.close()


def test_bench_tp_runs_both_sides_on_the_same_requests():
    from kvserve.bench.tp import run

    [row] = run("default", 2, [2], prompt_len=8, max_tokens=4, rounds=1)
    assert row["same tokens"] and row["1 rank tok/s"] > 0 and row["2 ranks tok/s"] > 0
    assert 0 < row["collectives share"] < 1
