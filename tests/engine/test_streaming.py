"""StreamingLLM's ring buffer in the engine (sinks + window, ``kvstore.ring``): the full cache's tokens while a
sequence is shorter than sinks + window, an independent StreamingLLM's past it (``streaming_reference``: the
paper's cache built by hand with transformers' modules), flat memory, prefix caching that never serves
overwritten KV, preemption, the prefill -> decode hand-off, and requests without the option unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_testing import NUM_NEW_TOKENS, greedy
from handoff_testing import RemoteLoads, drain
from streaming_reference import streaming_greedy

from engine import LLM, SamplingParams
from engine.input_batch import StagingBuffer, stage_step
from kvstore.ring import RingSpec
from prefill_service.handoff import Handoff, HandoffConnector

TINY_BLOCK = 4
TINY_CONTEXT = 64  # the tiny model's positions: streaming goes past them
TINY_CONFIG = {"max_position_embeddings": TINY_CONTEXT, "initializer_range": 0.1}  # (wide weights: clear argmaxes)


def streaming(window: int, sinks: int, max_tokens: int = NUM_NEW_TOKENS) -> SamplingParams:
    return greedy(max_tokens, streaming_window=window, streaming_sinks=sinks)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """Qwen2's layout (q/k/v biases), 2 layers, a 64-position context."""
    from kvserve.testing.random_model import write_random_model

    return write_random_model(tmp_path_factory.mktemp("tiny"), "qwen2-tiny", dtype=torch.float32,
                              overrides=TINY_CONFIG)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_hf(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()


def tiny_llm(tiny_dir, **options) -> LLM:
    return LLM(str(tiny_dir), skip_tokenizer_init=True, block_size=TINY_BLOCK, **{"num_blocks": 128, **options})


def tiny_prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- (1) shorter than sinks + window: the full cache, token for token ----------------------------------------


def test_shorter_than_sinks_plus_window_equals_the_full_cache(llm, engine_prompts, hf_greedy):
    """Prompts of 5 to 100 tokens, 32 new ones, sinks 4 + window 160: never past the window, so the ring (its
    kernels, sink-facing queries, ring slots) must give transformers' full-cache greedy tokens exactly."""
    picked = [0, 2, 4, 5]
    params = streaming(160, 4)
    assert llm.engine.ring_for(params) is not None
    outs = llm.generate([engine_prompts[i] for i in picked], params)
    for i, out in zip(picked, outs, strict=True):
        assert len(engine_prompts[i]) + NUM_NEW_TOKENS < 4 + 160
        assert out.token_ids == hf_greedy[i], f"prompt {i} ({len(engine_prompts[i])} tokens) diverged"


# -- (2) past it: an independent StreamingLLM -----------------------------------------------------------------


def test_past_the_window_the_bundled_model_matches_an_independent_streaming_llm(llm, hf_model, engine_prompts,
                                                                                  hf_greedy):
    """A 100-token prompt (prefilled in chunks through the ring) and 24 new tokens with sinks 4 + window 32:
    the engine's tokens are those of the paper's StreamingLLM over the same cache built by hand."""
    prompt = engine_prompts[5]
    [out] = llm.generate([prompt], streaming(32, 4, max_tokens=24))
    expected = streaming_greedy(hf_model, prompt, 24, sinks=4, window=32)
    assert out.token_ids == expected
    assert expected != hf_greedy[5][:24]  # the window matters here: the full cache's answer differs


@pytest.mark.parametrize("sinks", [2, 0], ids=["sinks", "window-only"])
def test_past_the_models_context_it_matches_an_independent_streaming_llm(tiny_dir, tiny_hf, sinks):
    """30 + 120 tokens on a model of 64 positions, window 12: absolute positions run past the rotary table
    (the reference's positions stay inside the cache) and the ring wraps many times."""
    llm = tiny_llm(tiny_dir)
    assert llm.engine.max_model_len == TINY_CONTEXT
    prompt = tiny_prompt(30)
    [out] = llm.generate([prompt], streaming(12, sinks, max_tokens=120))
    assert out.finish_reason == "length" and len(out.token_ids) == 120
    assert out.token_ids == streaming_greedy(tiny_hf, prompt, 120, sinks=sinks, window=12)


def test_a_long_prompt_is_prefilled_in_chunks_that_fit_the_ring(tmp_path):
    """A 44-token prompt with a step budget of 24: its second chunk (from position 24) would write over cached
    keys its own first queries read, in a ring of 5 blocks beside a window of 12, so it is capped to what the
    ring holds at once (``RingSpec.max_chunk``: 8 tokens there). Six layers carry a wrong key to the answer."""
    from transformers import AutoModelForCausalLM

    from kvserve.testing.random_model import write_random_model

    path = write_random_model(tmp_path, "qwen2-tiny", num_layers=6, dtype=torch.float32, overrides=TINY_CONFIG)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompt = tiny_prompt(44, seed=4)
    [out] = tiny_llm(path, max_num_batched_tokens=24).generate([prompt], streaming(12, 2, max_tokens=10))
    assert RingSpec(2, 12, TINY_BLOCK).max_chunk(24) == 8
    assert out.token_ids == streaming_greedy(hf, prompt, 10, sinks=2, window=12)


def test_a_batch_of_streaming_and_plain_requests(tiny_dir, tiny_hf):
    """Different windows and a plain request in one batch (decodes and prefill chunks mixed): each gets its
    own answer."""
    llm = tiny_llm(tiny_dir)
    prompts = [tiny_prompt(n, seed) for n, seed in ((9, 1), (40, 2), (22, 3))]
    params = [streaming(8, 1, 50), streaming(16, 3, 50), greedy(20)]
    outs = llm.generate(prompts, params)
    assert outs[0].token_ids == streaming_greedy(tiny_hf, prompts[0], 50, sinks=1, window=8)
    assert outs[1].token_ids == streaming_greedy(tiny_hf, prompts[1], 50, sinks=3, window=16)
    assert outs[2].token_ids == tiny_llm(tiny_dir).generate([prompts[2]], greedy(20))[0].token_ids


# -- (4) memory stays flat ------------------------------------------------------------------------------------


def test_memory_stays_flat_past_the_models_context(tiny_dir):
    llm = tiny_llm(tiny_dir)
    engine, ring = llm.engine, RingSpec(2, 12, TINY_BLOCK)
    rid = engine.add_request(tiny_prompt(30), streaming(12, 2, max_tokens=200))
    held, free = [], []
    while engine.has_unfinished_requests():
        outs = engine.step()
        if engine.block_manager.has(rid):
            held.append(len(engine.block_manager.block_table(rid)))
            free.append(engine.block_manager.num_free_blocks)
    assert max(held) == ring.max_blocks == 6  # 1 sink block + a ring of 5 (window 12, chunks of 4)
    assert set(free[held.index(ring.max_blocks) :]) == {128 - ring.max_blocks}
    assert outs[-1].finished and outs[-1].num_output_tokens == 200  # 230 tokens on a 64-position model
    assert engine.block_manager.num_free_blocks == 128


# -- prefix caching -------------------------------------------------------------------------------------------


def test_a_wrapped_ring_leaves_no_stale_block_in_the_prefix_cache(tiny_dir):
    """A streaming request registers only the blocks a full cache would have computed the same (below sinks +
    window) and uncaches them when its ring writes over them: a later plain request with the same prompt
    reuses at most those, and answers as on a fresh engine."""
    llm = tiny_llm(tiny_dir)
    prompt = tiny_prompt(40, seed=5)
    llm.generate([prompt], streaming(12, 2, max_tokens=30))  # sinks + window: 14 tokens, 3 full blocks
    [plain] = llm.generate([prompt + [7]], greedy(12))
    assert plain.num_cached_tokens == TINY_BLOCK  # the sink block: the ring's blocks were overwritten
    assert plain.token_ids == tiny_llm(tiny_dir).generate([prompt + [7]], greedy(12))[0].token_ids


def test_a_ring_never_writes_over_a_block_it_shares(tiny_dir):
    """A plain request's prompt blocks are cached; a streaming request with the same prefix shares them, then
    wraps: it must take fresh blocks instead of writing over the plain request's, which keeps decoding."""
    llm = tiny_llm(tiny_dir)
    engine, prompt = llm.engine, tiny_prompt(24, seed=6)
    alone = tiny_llm(tiny_dir).generate([prompt], greedy(40))[0].token_ids
    plain = engine.add_request(prompt, greedy(40))
    engine.step()  # its prompt: cached now
    stream = engine.add_request(prompt + tiny_prompt(6, seed=7), streaming(12, 2, max_tokens=40))
    final = drain(engine)
    assert final[stream].num_cached_tokens == 12  # shared the 3 blocks below sinks + window
    assert final[plain].token_ids == alone


# -- preemption and the hand-off ------------------------------------------------------------------------------


def test_preempted_streaming_sequences_recompute_the_same_ring(tiny_dir):
    """Rings of up to 6 blocks in a pool of 14: three 13-token prompts are admitted (4 blocks each), their rings
    grow and the latest is preempted, then recomputed (prompt and output, past sinks + window, through its
    ring again): every answer is the one a large pool gives."""
    prompts = [tiny_prompt(13, seed=10 + i) for i in range(4)]
    params = streaming(12, 2, max_tokens=60)
    expected = [o.token_ids for o in tiny_llm(tiny_dir).generate(prompts, params)]
    outs = tiny_llm(tiny_dir, num_blocks=14).generate(prompts, params)
    assert sum(o.num_preemptions for o in outs) > 0
    assert [o.token_ids for o in outs] == expected


def test_the_handoff_carries_a_prompt_within_the_window_and_a_longer_one_is_computed_locally(tiny_dir):
    """Prefill -> decode moves blocks by their place in the table: a streaming prompt within sinks + window is
    prefilled remotely (same table on both sides) and decoding wraps the ring on the decode side; a longer
    prompt, whose ring wraps during its prefill, is never loaded from outside: the decode engine computes it."""
    params = streaming(12, 2, max_tokens=40)
    short, long = tiny_prompt(13, seed=20), tiny_prompt(30, seed=21)
    expected = [o.token_ids for o in tiny_llm(tiny_dir).generate([short, long], params)]

    loads = RemoteLoads()
    decode, prefill = tiny_llm(tiny_dir).engine, tiny_llm(tiny_dir).engine
    decode.connect(loads)
    prefill.connect(HandoffConnector(prefill.runner.kv_pool, TINY_BLOCK))
    decode.add_request(short, params, "short", kv_params="remote")
    decode.add_request(long, params, "long", kv_params="remote")
    decode.step()
    assert set(decode.scheduler.waiting_for_kv) == {"short"}  # "long" is computed here
    table, _ = loads.tables["short"]
    rid = prefill.add_request(short, SamplingParams(**{**vars(params), "max_tokens": 1}),
                              kv_params=Handoff(decode.runner.kv_pool, table, TINY_BLOCK))  # fmt: skip
    first = drain(prefill)[rid].token_ids[0]
    loads.finish("short", first)
    final = drain(decode)
    assert [final["short"].token_ids, final["long"].token_ids] == expected


# -- (7) a request without the option --------------------------------------------------------------------------


def test_a_batch_without_windows_stages_no_ring(llm, engine_prompts):
    """Requests without the option take today's path: no ring metadata, so neither the second query nor the
    windowed kernels run; a batch with one streaming request gives it to that request only."""
    engine = llm.engine
    plain = engine._new_sequence(engine_prompts[1], greedy(), "p")
    windowed = engine._new_sequence(engine_prompts[1], streaming(64, 4), "s")
    assert plain.ring is None and windowed.ring == RingSpec(4, 64, 16)
    for seq in (plain, windowed):
        seq.block_table = np.arange(2, dtype=np.int32)
    buffer = StagingBuffer(1 << 16, engine.runner.device)
    assert stage_step(buffer, [plain], [16], 0, 16).meta.ring is None
    mixed = stage_step(buffer, [plain, windowed], [16, 16], 0, 16).meta.ring
    assert mixed.rows.tolist() == [[0, 1 << 30, 0, 1 << 30], [4, 64, 1, RingSpec(4, 64, 16).ring_blocks]]


def test_requests_without_the_option_are_unchanged(engine_prompts, hf_greedy):
    """An engine whose default is streaming still serves a request that turns it off (streaming_window=0) with
    the full cache, beside streaming ones in the same batch."""
    llm = LLM("default", block_size=16, num_blocks=256, streaming_window=32)
    outs = llm.generate([engine_prompts[4], engine_prompts[5]], [greedy(streaming_window=0), greedy()])
    assert outs[0].token_ids == hf_greedy[4]
    assert outs[1].token_ids != hf_greedy[5]  # the engine's default: a window of 32 past a 100-token prompt
