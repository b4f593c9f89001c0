"""Parallel sampling (``n`` choices of one prompt): the choices' tokens, their seeds, the prompt computed once
with or without prefix caching, and every block back when the request ends."""

from __future__ import annotations

import pytest
from engine_testing import BLOCK_SIZE, greedy

from engine import LLMEngine, RequestOutput, SamplingParams

NUM_BLOCKS = 64


def _engine(**options) -> LLMEngine:
    return LLMEngine(model="default", block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, **options)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return _engine()


def _choices(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    """The final output of each choice of one request, by index; every output carries the request's id."""
    rid = engine.add_request(prompt, params)
    final: dict[int, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid
            if out.finished:
                final[out.index] = out
    assert sorted(final) == list(range(params.n))
    return [final[i] for i in range(params.n)]


def _count_computed(engine: LLMEngine) -> list[int]:
    """A list that collects the tokens each scheduled step computes, from now on."""
    counts: list[int] = []
    schedule = engine.scheduler.schedule

    def counting():
        batch = schedule()
        counts.append(batch.num_tokens)
        return batch

    engine.scheduler.schedule = counting
    return counts


def test_greedy_choices_equal_the_single_answer_and_share_the_prompt(engine, engine_prompts):
    prompt = engine_prompts[4]  # 47 tokens: two full blocks and a partial one
    alone = _choices(engine, prompt, greedy(8))[0]
    outs = _choices(_engine(), prompt, greedy(8, n=4))
    assert [o.token_ids for o in outs] == [alone.token_ids] * 4
    assert [o.text for o in outs] == [alone.text] * 4
    # choice 0 computed the prompt; the others shared its two full blocks
    assert [o.num_cached_tokens for o in outs] == [0, 32, 32, 32]


@pytest.mark.parametrize("caching", [True, False])
def test_prompt_is_computed_once(engine_prompts, caching):
    engine = _engine(enable_prefix_caching=caching)
    prompt = engine_prompts[5]  # 100 tokens: six full blocks and 4 tokens
    computed = _count_computed(engine)
    outs = _choices(engine, prompt, greedy(4, n=3))
    # choice 0: the prompt; choices 1 and 2: the 4 tokens of its last partial block; then 3 decode steps each
    assert sum(computed) == 100 + 2 * 4 + 3 * 3
    assert [o.num_cached_tokens for o in outs] == [0, 96, 96]
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS


def test_seeded_choices_differ_and_are_reproducible(engine, engine_prompts):
    prompt = engine_prompts[2]
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True, n=3)
    outs = _choices(engine, prompt, params)
    tokens = [o.token_ids for o in outs]
    assert len({tuple(t) for t in tokens}) == 3
    assert [o.token_ids for o in _choices(engine, prompt, params)] == tokens
    for i in range(3):  # choice i draws from seed + i: alone, with that seed, it is the same
        alone = SamplingParams(temperature=1.0, seed=1234 + i, max_tokens=12, ignore_eos=True)
        assert _choices(engine, prompt, alone)[0].token_ids == tokens[i]
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS


def test_unseeded_choices_differ(engine, engine_prompts):
    outs = _choices(engine, engine_prompts[1], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, n=2))
    assert outs[0].token_ids != outs[1].token_ids


def test_choices_finish_apart_and_abort_ends_them_all(engine, engine_prompts):
    prompt = engine_prompts[4]
    rid = engine.add_request(prompt, greedy(8, n=3))
    engine.step()  # choice 0 computes the prompt; 1 and 2 are queued behind it
    assert engine.scheduler.waiting and engine.has_unfinished_requests()
    assert engine.abort(rid)
    assert not engine.has_unfinished_requests() and not engine.abort(rid)
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS
    held = engine.add_request(prompt, greedy(8, n=2))  # aborted while its choice 1 is still held back
    assert engine.abort(held) and not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS


def test_only_choice_0_scores_the_prompt_and_continuations_are_one_choice(engine, engine_prompts):
    outs = _choices(engine, engine_prompts[3], greedy(2, n=2, prompt_logprobs=0))
    assert outs[0].prompt_logprobs is not None and outs[1].prompt_logprobs is None
    from engine import Continuation

    with pytest.raises(ValueError, match="n=2"):
        engine.add_request(engine_prompts[3], greedy(4, n=2), continuation=Continuation((1,), 0))
    with pytest.raises(ValueError, match=r"n must be an integer in \[1, 16\]"):
        SamplingParams(n=17)
