"""Automatic prefix caching: hits are token-exact, counted exactly, evicted least recently used, never served
on a hash alone (the hand-off of a prompt's KV between two engines is in ``test_handoff.py``)."""

from __future__ import annotations

import pytest
import torch
from engine_testing import BLOCK_SIZE, greedy

from engine import LLM, LLMEngine
from kvstore import KVCache, KVCacheSpec, block_manager
from kvstore.kv_cache import copy_blocks
from kvstore.prefix_hash import block_hashes
from transfer.blocks import read_blocks

NUM_BLOCKS = 64


def _llm(**options) -> LLM:
    return LLM("default", block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, **options)


@pytest.fixture(scope="module")
def cold() -> LLM:
    """The reference: the same engine with prefix caching off."""
    return _llm(enable_prefix_caching=False)


def _drain(engine: LLMEngine) -> dict:
    """Step until every request finished; the final output of each, by request id."""
    final = {}
    while engine.has_unfinished_requests():
        final.update((out.request_id, out) for out in engine.step() if out.finished)
    return final


def test_shared_prefixes_of_one_block_many_blocks_and_all_but_one_token(engine_prompts, hf_greedy):
    p = engine_prompts
    llm = _llm(max_num_batched_tokens=40)  # the rest of each prompt is computed in chunks over its cached prefix
    warm = [p[4][:16] + p[0], p[6][:128] + p[1], p[3][:16] + p[0], p[2]]
    assert [o.num_cached_tokens for o in llm.generate(warm, greedy(1))] == [0, 0, 0, 0]
    outs = llm.generate([p[4], p[6], p[3], p[2]], greedy())
    # p[3] has 17 tokens: only its last is computed; p[2] is two whole cached blocks: its last block is redone.
    assert [o.num_cached_tokens for o in outs] == [16, 128, 16, 16]
    assert [o.token_ids for o in outs] == [hf_greedy[4], hf_greedy[6], hf_greedy[3], hf_greedy[2]]
    assert llm.engine.block_manager.num_free_blocks == NUM_BLOCKS


def test_requests_sharing_a_prefix_in_one_batch_and_output_blocks(engine_prompts, hf_greedy, cold):
    p = engine_prompts
    llm = _llm()
    batch = [p[5], p[5][:64] + p[0], p[5][:64] + p[1]]
    outs = llm.generate(batch, greedy(16))
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]  # admitted together: nothing was computed yet
    assert outs[0].token_ids == hf_greedy[5][:16]
    assert [o.token_ids for o in outs] == [o.token_ids for o in cold.generate(batch, greedy(16))]
    again = llm.generate(batch[1:], greedy(16))
    assert [o.num_cached_tokens for o in again] == [64, 64]
    assert [o.token_ids for o in again] == [o.token_ids for o in outs[1:]]
    # Output tokens' full blocks are cached too: a follow-up that repeats the answer reuses them.
    [first] = llm.generate([p[1]], greedy(20))
    follow_up = p[1] + first.token_ids  # 36 tokens; the first 32 (16 prompt + 16 output) are cached
    [hit] = llm.generate([follow_up], greedy(8))
    assert hit.num_cached_tokens == 32
    assert hit.token_ids == cold.generate([follow_up], greedy(8))[0].token_ids


def test_an_evicted_prefix_is_recomputed_least_recently_used_tail_first(engine_prompts, hf_greedy):
    p = engine_prompts
    llm = LLM("default", block_size=BLOCK_SIZE, num_blocks=16)
    engine = llm.engine
    [first] = llm.generate([p[6]], greedy())  # 170 + 32 tokens: 13 blocks, the 12 full ones cached
    hashes = block_hashes(p[6] + first.token_ids[:-1], BLOCK_SIZE, engine.prefix_salt)
    assert len(hashes) == 12 and engine.take_prefix_events() == (hashes, [])
    [other] = llm.generate([p[5]], greedy())  # 9 blocks: the 3 never used, then the first's tail, evicting 5
    stored, evicted = engine.take_prefix_events()
    assert len(stored) == 8 and sorted(evicted) == sorted(hashes[7:12])
    assert sorted(engine.cached_block_hashes()) == sorted(hashes[:7] + stored)
    [again] = llm.generate([p[6]], greedy())
    assert (first.num_cached_tokens, other.num_cached_tokens, again.num_cached_tokens) == (0, 0, 7 * BLOCK_SIZE)
    assert first.token_ids == again.token_ids == hf_greedy[6]
    assert other.token_ids == hf_greedy[5]


def _position_only_hashes(token_ids, block_size, salt, parent=""):
    """Every prompt's block ``i`` gets the same hash: the worst possible collisions."""
    return [parent + "x" for _ in range(len(token_ids) // block_size)]


def test_a_forced_hash_collision_is_caught_by_the_token_check(engine_prompts, hf_greedy, monkeypatch):
    monkeypatch.setattr(block_manager, "block_hashes", _position_only_hashes)
    p = engine_prompts
    llm = _llm()
    assert llm.generate([p[4]], greedy(16))[0].token_ids == hf_greedy[4][:16]
    [other] = llm.generate([p[5]], greedy(16))  # its blocks' hashes all equal p[4]'s
    assert other.num_cached_tokens == 0 and other.token_ids == hf_greedy[5][:16]
    [same] = llm.generate([p[5]], greedy(16))  # equal tokens still hit
    assert same.num_cached_tokens == 96 and same.token_ids == hf_greedy[5][:16]
    [displaced] = llm.generate([p[4]], greedy(16))  # p[5]'s blocks took over the colliding hashes
    assert displaced.num_cached_tokens == 0 and displaced.token_ids == hf_greedy[4][:16]


def test_caching_off_hashes_and_reports_nothing(engine_prompts, cold):
    outs = cold.generate([engine_prompts[2], engine_prompts[2]], greedy(4))
    outs += cold.generate([engine_prompts[2]], greedy(4))
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]
    assert cold.engine.cached_block_hashes() == [] and cold.engine.take_prefix_events() == ([], [])


def test_copy_blocks_moves_every_layers_k_v_and_int8_scales():
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32,
                       kv_cache_dtype="int8")  # fmt: skip
    src, dst = KVCache(spec, 6, "cpu"), KVCache(spec, 5, "cpu")
    src.buffer.copy_(torch.randint(0, 256, src.buffer.shape, dtype=torch.uint8))
    untouched = read_blocks(dst, [0, 2, 3])
    copy_blocks(src.layers, [5, 1], dst.layers, [4, 1])
    assert read_blocks(dst, [4, 1]) == read_blocks(src, [5, 1])
    assert read_blocks(dst, [0, 2, 3]) == untouched
