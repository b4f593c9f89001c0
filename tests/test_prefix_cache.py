"""Automatic prefix caching: hits are token-exact, counted exactly, evicted least recently used, never served
on a hash alone, and the disaggregated calls (reserve / add_prefilled / a prefill into a partly cached
destination) move exactly the KV the other side lacks."""

from __future__ import annotations

import argparse

import pytest
import torch
from conftest import BLOCK_SIZE, greedy

from engine import LLM, LLMEngine, SamplingParams
from kvstore import KVCache, KVCacheSpec, block_manager
from kvstore.kv_cache import copy_blocks
from kvstore.prefix_hash import block_hashes
from kvstore.transfer import read_blocks
from rpc.flags import add_engine_args, engine_args_to_argv, engine_config_from_args

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


# -- disaggregated prefill -------------------------------------------------------------------------------------


def _prefill_into(prefill: LLMEngine, prompt, layers, table, num_dest_cached_tokens) -> int:
    """Prefill ``prompt`` on ``prefill`` straight into blocks ``table`` of the pool ``layers``; the first token."""
    rid = prefill.add_request(prompt, greedy(1), kv_destination=(layers, table), hold_blocks=True,
                              num_dest_cached_tokens=num_dest_cached_tokens)  # fmt: skip
    first = _drain(prefill)[rid].token_ids[0]
    prefill.release(rid)
    return first


def _decode(decode: LLMEngine, rid: str, prompt, first_token: int) -> tuple[list[int], int]:
    """Decode a prefilled request to its end: (its tokens, its num_cached_tokens)."""
    out = decode.add_prefilled(rid, prompt, greedy(), first_token)
    final = out if out.finished else _drain(decode)[rid]
    return final.token_ids, final.num_cached_tokens


def _warm(engine: LLMEngine, prompt) -> None:
    engine.add_request(prompt, greedy(1))
    _drain(engine)


def test_reserve_reuses_cached_blocks_and_an_unfilled_reservation_is_not_cached(engine_prompts, hf_greedy):
    p = engine_prompts
    decode, prefill = _llm().engine, _llm().engine
    table, num_cached = decode.reserve("r1", p[6])
    assert num_cached == 0 and len(table) == 11
    assert decode.cached_block_hashes() == []  # reserved blocks are not findable before they are filled
    first = _prefill_into(prefill, p[6], decode.runner.kv_cache.layers, table, 0)
    assert _decode(decode, "r1", p[6], first) == (hf_greedy[6], 0)
    prompt_hashes = block_hashes(p[6], BLOCK_SIZE, decode.prefix_salt)
    assert set(prompt_hashes) <= set(decode.cached_block_hashes())

    shared, num_cached = decode.reserve("r2", p[6][:128] + p[1])
    assert num_cached == 128 and shared[:8] == table[:8]
    decode.release("r2")
    before = set(decode.cached_block_hashes())
    _, num_cached = decode.reserve("r3", p[5])  # never filled
    assert num_cached == 0
    decode.release("r3")
    assert set(decode.cached_block_hashes()) == before
    assert decode.reserve("r4", p[5])[1] == 0 and decode.block_manager.num_free_blocks == NUM_BLOCKS - 7
    decode.release("r4")
    assert decode.prefix_salt == prefill.prefix_salt


@pytest.mark.parametrize("prefill_caches", [True, False], ids=["prefill-cached-more", "prefill-cold"])
def test_prefill_writes_exactly_the_blocks_the_destination_lacks(engine_prompts, cold, prefill_caches):
    prompt = engine_prompts[6]  # 170 tokens: 10 full blocks and a partial one
    prefill = _llm().engine if prefill_caches else cold.engine
    if prefill_caches:
        _warm(prefill, prompt)  # the prefill side has 160 of its tokens cached: it copies 64..160, computes the rest
    destination = KVCache(prefill.runner.kv_spec, 16, "cpu")
    destination.buffer.fill_(0x5A)
    table = [15, 3, 9, 0, 12, 5, 1, 14, 7, 10, 2]
    held = read_blocks(destination, table[:4])  # the destination's own 64 cached tokens
    _prefill_into(prefill, prompt, destination.layers, table, 64)
    assert read_blocks(destination, table[:4]) == held  # never written: others may be reading them
    rid = cold.engine.add_request(prompt, greedy(1), hold_blocks=True)
    _drain(cold.engine)
    reference = read_blocks(cold.engine.runner.kv_cache, cold.engine.block_manager.block_table(rid)[4:10])
    cold.engine.release(rid)
    assert read_blocks(destination, table[4:10]) == reference  # the bytes of a cold computation


def test_decode_continues_exactly_over_its_cached_prefix_and_a_partly_cached_prefill(engine_prompts, hf_greedy):
    prompt = engine_prompts[6]
    decode, prefill = _llm().engine, _llm().engine
    _warm(prefill, prompt)
    _warm(decode, prompt[:64] + engine_prompts[0])
    table, num_cached = decode.reserve("r", prompt)
    assert num_cached == 64
    first = _prefill_into(prefill, prompt, decode.runner.kv_cache.layers, table, num_cached)
    assert _decode(decode, "r", prompt, first) == (hf_greedy[6], 64)


def _cold_prefill(cold: LLM, prompt, *spans: slice) -> tuple[int, list[bytes]]:
    """(first token, the KV bytes of each span of the prompt's blocks) of a prefill that computes everything."""
    rid = cold.engine.add_request(prompt, greedy(1), hold_blocks=True)
    first = _drain(cold.engine)[rid].token_ids[0]
    table = cold.engine.block_manager.block_table(rid)
    data = [read_blocks(cold.engine.runner.kv_cache, table[span]) for span in spans]
    cold.engine.release(rid)
    return first, data


@pytest.mark.parametrize("own_cached", [0, 32, None], ids=["caching-off", "own-prefix-shorter", "caching-on"])
def test_a_prefill_reads_the_destinations_cached_prefix_instead_of_computing_it(engine_prompts, hf_greedy, cold,
                                                                                own_cached):  # fmt: skip
    prompt = engine_prompts[6]  # 170 tokens: 10 full blocks and a partial one
    decode = _llm().engine
    _warm(decode, prompt[:128] + engine_prompts[0])  # the destination computed the prompt's first 8 blocks
    table, num_cached = decode.reserve("r", prompt)
    held = read_blocks(decode.runner.kv_cache, table[:8])
    prefill = _llm(enable_prefix_caching=own_cached is not None).engine
    if own_cached:
        _warm(prefill, prompt[:own_cached] + engine_prompts[0])  # it holds the first 2 blocks itself
    rid = prefill.add_request(prompt, greedy(1), kv_destination=(decode.runner.kv_cache.layers, table),
                              hold_blocks=True, num_dest_cached_tokens=num_cached, read_dest_prefix=True)  # fmt: skip
    out = _drain(prefill)[rid]
    own = own_cached or 0
    assert (num_cached, out.num_cached_tokens, out.num_dest_read_tokens) == (128, own, 128 - own)
    own_blocks = prefill.block_manager.block_table(rid)
    assert read_blocks(prefill.runner.kv_cache, own_blocks[:8]) == held  # imported into its own blocks
    prefill.release(rid)
    first, (prefix, tail) = _cold_prefill(cold, prompt, slice(0, 8), slice(8, 10))
    assert out.token_ids[0] == first
    assert prefix == held  # what it read is what recomputing gives, so the tail it wrote is too
    assert read_blocks(decode.runner.kv_cache, table[8:10]) == tail
    assert read_blocks(decode.runner.kv_cache, table[:8]) == held  # read, never written
    assert _decode(decode, "r", prompt, out.token_ids[0]) == (hf_greedy[6], 128)
    if own_cached is not None:  # its own prefix cache now serves the imported blocks
        again = prefill.add_request(prompt[:128] + engine_prompts[1], greedy(4))
        hit = _drain(prefill)[again]
        assert hit.num_cached_tokens == 128 and hit.num_dest_read_tokens == 0
        assert hit.token_ids == cold.generate([prompt[:128] + engine_prompts[1]], greedy(4))[0].token_ids


def test_a_preempted_prefill_reads_the_destinations_prefix_again(engine_prompts, cold):
    prompt = engine_prompts[6]
    decode = _llm().engine
    _warm(decode, prompt[:64] + engine_prompts[0])
    table, num_cached = decode.reserve("r", prompt)
    # 12 blocks, 32 tokens a step: the prefill (11 blocks) runs beside a decoding request until the pool is full,
    # then it is preempted (the most recently admitted) and admitted again, reading the 4 blocks once more.
    prefill = LLM("default", block_size=BLOCK_SIZE, num_blocks=12, max_num_batched_tokens=32,
                  enable_prefix_caching=False).engine  # fmt: skip
    neighbour = prefill.add_request(engine_prompts[1], greedy(40))
    rid = prefill.add_request(prompt, greedy(1), kv_destination=(decode.runner.kv_cache.layers, table),
                              hold_blocks=True, num_dest_cached_tokens=num_cached, read_dest_prefix=True)  # fmt: skip
    outs = _drain(prefill)
    prefill.release(rid)
    assert outs[rid].num_preemptions >= 1 and outs[rid].num_dest_read_tokens == 64
    first, (written,) = _cold_prefill(cold, prompt, slice(4, 10))
    assert outs[rid].token_ids[0] == first
    assert read_blocks(decode.runner.kv_cache, table[4:10]) == written
    assert outs[neighbour].token_ids == cold.generate([engine_prompts[1]], greedy(40))[0].token_ids
    decode.release("r")


def test_num_dest_cached_tokens_is_validated(engine_prompts, cold):
    dest = (cold.engine.runner.kv_cache.layers, list(range(11)))
    for bad, destination in [(8, dest), (170, dest), (16, None)]:
        with pytest.raises(ValueError, match="num_dest_cached_tokens"):
            cold.engine.add_request(engine_prompts[6], SamplingParams(max_tokens=1), kv_destination=destination,
                                    num_dest_cached_tokens=bad)  # fmt: skip
    with pytest.raises(ValueError, match="read_dest_prefix"):
        cold.engine.add_request(engine_prompts[6], SamplingParams(max_tokens=1), kv_destination=dest,
                                read_dest_prefix=True)  # fmt: skip


def test_the_worker_flag_parses_true_or_false_and_round_trips():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--enable-prefix-caching", "false"])
    assert engine_config_from_args(args).enable_prefix_caching is False
    again = parser.parse_args(engine_args_to_argv(args))
    assert again.enable_prefix_caching is False and engine_config_from_args(again).enable_prefix_caching is False
    assert parser.parse_args(["--enable-prefix-caching", "TRUE"]).enable_prefix_caching is True
    assert engine_config_from_args(parser.parse_args([])).enable_prefix_caching is True
    with pytest.raises(SystemExit):
        parser.parse_args(["--enable-prefix-caching", "maybe"])


def test_copy_blocks_moves_every_layers_k_v_and_int8_scales():
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32,
                       kv_cache_dtype="int8")  # fmt: skip
    src, dst = KVCache(spec, 6, "cpu"), KVCache(spec, 5, "cpu")
    src.buffer.copy_(torch.randint(0, 256, src.buffer.shape, dtype=torch.uint8))
    untouched = read_blocks(dst, [0, 2, 3])
    copy_blocks(src.layers, [5, 1], dst.layers, [4, 1])
    assert read_blocks(dst, [4, 1]) == read_blocks(src, [5, 1])
    assert read_blocks(dst, [0, 2, 3]) == untouched
