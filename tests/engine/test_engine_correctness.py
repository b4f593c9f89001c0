"""The engine's tokens against Hugging Face transformers, and against itself under batching, preemption and chunking."""

from __future__ import annotations

import pytest
import torch
from engine_testing import BLOCK_SIZE, greedy

from engine import LLM, SamplingParams
from engine.models import linear


def test_greedy_matches_transformers_one_prompt_at_a_time(llm, engine_prompts, hf_greedy):
    # under a block, exactly a block, a block and one, many blocks (all eight, batched, in the next test)
    for i in (0, 1, 3, 6):
        prompt, expected = engine_prompts[i], hf_greedy[i]
        [out] = llm.generate([prompt], greedy())
        assert out.token_ids == expected, f"prompt of {len(prompt)} tokens diverged from transformers"
        assert out.finish_reason == "length"


def test_batched_equals_unbatched(llm, engine_prompts, hf_greedy):
    outs = llm.generate(engine_prompts, greedy())
    assert [o.token_ids for o in outs] == hf_greedy
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_decode_products_split_over_the_weights_rows_match_transformers(llm, engine_prompts, hf_greedy, monkeypatch):
    """Where a weight has no packed copy (a CPU without oneDNN, a dtype other than float32) and there is more
    than one thread, a decode step's products run as a bmm over blocks of each weight's rows
    (``engine.models.linear``); forced here without the packed copies, on one thread, alone and in a batch."""
    for module in llm.engine.runner.model.modules():
        if isinstance(module, linear.Linear):
            monkeypatch.setattr(module, "packed", None)
    calls = []

    def split_blocks(x, weight):
        calls.append(x.shape[0])
        return 8 if x.shape[0] <= linear.SPLIT_MAX_ROWS and weight.shape[0] % 8 == 0 else 1

    monkeypatch.setattr(linear, "split_blocks", split_blocks)
    [alone] = llm.generate([engine_prompts[0]], greedy())
    outs = llm.generate(engine_prompts, greedy())
    assert alone.token_ids == hf_greedy[0] and [o.token_ids for o in outs] == hf_greedy
    assert 1 in calls and len(engine_prompts) in calls  # the decode steps' rows went through the split


def test_packed_weights_give_the_plain_product(llm):
    """Every float32 product on the CPU goes through the weight's oneDNN-packed copy (``pack_for_onednn``): its
    rows equal ``F.linear``'s over the plain weight within float32 rounding, for a decode's rows and a prefill's."""
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, linear.Linear)]
    assert layers and all(m.packed is not None for m in layers)
    torch.manual_seed(0)
    for module in (layers[0], layers[-1]):  # a layer's QKV product and the LM head
        for rows in (1, 3, 16, 300):
            x = torch.randn(rows, module.in_features)
            with torch.inference_mode():
                got, want = module(x), torch.nn.functional.linear(x, module.weight, module.bias)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_small_pool_preempts_and_chunked_prefill_still_match(engine_prompts, hf_greedy):
    # 40 blocks hold 640 tokens; the prompts and their answers need ~800, so sequences must be preempted.
    small = LLM("default", block_size=BLOCK_SIZE, num_blocks=40, max_num_batched_tokens=64)
    outs = small.generate(engine_prompts, greedy())
    assert small.engine.scheduler.num_preemptions > 0
    assert sum(o.num_preemptions for o in outs) > 0
    assert [o.token_ids for o in outs] == hf_greedy
    assert small.engine.block_manager.num_free_blocks == 40


def test_text_and_token_prompts_agree(llm, tokenizer):
    text = "Once upon a time, in a small village,"
    [a] = llm.generate(text, greedy(12))
    [b] = llm.generate([tokenizer.encode(text)], greedy(12))
    assert a.token_ids == b.token_ids
    assert a.text == tokenizer.decode(a.token_ids)


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(llm, engine_prompts):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    prompt = engine_prompts[4]
    [alone] = llm.generate([prompt], seeded)
    [again] = llm.generate([prompt], seeded)
    assert alone.token_ids == again.token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=s) for s in (1, 2)]
    unseeded = SamplingParams(temperature=1.0, max_tokens=15, ignore_eos=True)  # outlives the seeded rows
    batch = llm.generate(
        [engine_prompts[0], prompt, engine_prompts[6], engine_prompts[2]], [others[0], seeded, unseeded, others[1]]
    )
    assert batch[1].token_ids == alone.token_ids
    [different] = llm.generate([prompt], SamplingParams(temperature=0.9, seed=99, max_tokens=12, ignore_eos=True))
    assert different.token_ids != alone.token_ids


def test_top_k_one_equals_greedy(llm, engine_prompts, hf_greedy):
    params = SamplingParams(temperature=0.7, top_k=1, seed=5, max_tokens=32, ignore_eos=True)
    outs = llm.generate(engine_prompts[:3], params)
    assert [o.token_ids for o in outs] == hf_greedy[:3]


def test_stop_conditions(llm, tokenizer):
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    [free] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40))
    assert free.finish_reason == "stop" and free.token_ids[-1] in llm.engine.eos_token_ids
    assert "Paris" in free.text

    [ignored] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 40
    assert ignored.token_ids[: len(free.token_ids)] == free.token_ids

    stop_id = free.token_ids[2]
    [by_id] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_id]))
    assert by_id.finish_reason == "stop" and by_id.token_ids == free.token_ids[:3]

    [by_text] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, stop=["Paris"]))
    assert by_text.finish_reason == "stop"
    assert by_text.text == free.text[: free.text.index("Paris")]

    [short] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3))
    assert short.finish_reason == "length" and short.token_ids == free.token_ids[:3]


def test_streamed_deltas_concatenate_to_final_text(llm):
    engine = llm.engine
    rid = engine.add_request(
        "The three primary colors are", SamplingParams(temperature=0, max_tokens=30, stop=[" and"])
    )
    pieces, final = [], None
    while final is None:
        for out in engine.step():
            if out.request_id == rid:
                pieces.append(out.new_text)
                final = out if out.finished else None
    assert "".join(pieces) == final.text


def test_abort_frees_blocks(llm, engine_prompts):
    engine = llm.engine
    rid = engine.add_request(engine_prompts[6], greedy(100))
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    assert engine.abort(rid)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.abort(rid)
    assert not engine.has_unfinished_requests()


def test_repetition_penalty_changes_output_and_stays_deterministic(llm, engine_prompts):
    prompt = engine_prompts[5]
    base = llm.generate([prompt], greedy(24))[0].token_ids
    a = llm.generate([prompt], greedy(24, repetition_penalty=1.5))[0].token_ids
    b = llm.generate([prompt], greedy(24, repetition_penalty=1.5))[0].token_ids
    assert a == b and a != base


@pytest.mark.parametrize("max_num_batched_tokens", [7, 33])
def test_chunked_prefill_of_long_prompt(llm, engine_prompts, hf_greedy, max_num_batched_tokens):
    chunked = LLM("default", block_size=BLOCK_SIZE, num_blocks=64, max_num_batched_tokens=max_num_batched_tokens)
    [out] = chunked.generate([engine_prompts[6]], greedy())
    assert out.token_ids == hf_greedy[6]
