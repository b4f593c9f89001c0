"""The hand-off between two engines through their KV connectors, without servers: a prefill engine with the
prefill worker's ``HandoffConnector`` writes a prompt's KV into blocks of a decode engine, whose requests wait
for it in WAITING_FOR_REMOTE_KV (a test connector plays the decode worker's remote prefill). It moves exactly
the KV the decode side lacks, reads the decode side's cached prefix instead of computing it, and the decode
side continues token-exact. What it copies is compared byte for byte with its source; what it computes is
compared with a cold engine's computation of the same prompt: byte for byte where both compute it the same
way, within ``KV_TOLERANCE`` where the schedules differ (tests/conftest.py's docstring)."""

from __future__ import annotations

import time

import pytest
import torch
from engine_testing import BLOCK_SIZE, assert_kv_close, greedy, kv_values
from handoff_testing import RemoteLoads, drain

from engine import LLM, LLMEngine
from engine.kv_connector import TRANSFER_EXPIRED
from kvstore import KVCache, split_pool
from kvstore.prefix_hash import block_hashes
from kvstore.split_pool import SplitPool
from prefill_service.handoff import Handoff, HandoffConnector
from transfer.blocks import read_blocks

NUM_BLOCKS = 64


def _engine(connector=None, **options) -> LLMEngine:
    engine = LLM("default", block_size=BLOCK_SIZE, **{"num_blocks": NUM_BLOCKS, **options}).engine
    if connector == "handoff":
        engine.connect(HandoffConnector(engine.runner.kv_pool, BLOCK_SIZE))
    elif connector is not None:
        engine.connect(connector)
    return engine


def _warm(engine: LLMEngine, prompt) -> None:
    engine.add_request(prompt, greedy(1))
    drain(engine)


def _reserve(decode: LLMEngine, loads: RemoteLoads, rid: str, prompt) -> tuple[list[int], int]:
    """Add a remote-prefilled request to ``decode``: (its block table, num_cached_tokens) once admitted."""
    decode.add_request(prompt, greedy(), rid, kv_params="remote")
    assert decode.step() == [] and rid in decode.scheduler.waiting_for_kv
    return loads.tables[rid]


def _prefill_into(prefill: LLMEngine, prompt, handoff: Handoff) -> tuple[int, object]:
    """(first token, final output) of ``prompt`` prefilled on ``prefill`` (a hand-off engine) into ``handoff``."""
    rid = prefill.add_request(prompt, greedy(1), kv_params=handoff)
    out = drain(prefill)[rid]
    prefill.release(rid)
    return (out.token_ids[0] if out.token_ids else None), out


def _cold_prefill(cold: LLMEngine, prompt, *spans: slice) -> tuple[int, list[torch.Tensor]]:
    """(first token, ``kv_values`` of each span of the prompt's blocks) of a prefill that computes everything,
    the whole prompt in one step."""
    rid = cold.add_request(prompt, greedy(1), kv_params=Handoff(None, [], BLOCK_SIZE))  # only keeps its blocks
    first = drain(cold)[rid].token_ids[0]
    table = cold.block_manager.block_table(rid)
    data = [kv_values(cold.runner.kv_cache, table[span]) for span in spans]
    cold.release(rid)
    return first, data


@pytest.fixture(scope="module")
def cold() -> LLMEngine:
    """The reference: a hand-off engine with prefix caching off (``_cold_prefill`` keeps a request's blocks)."""
    return _engine("handoff", enable_prefix_caching=False)


def test_a_remote_load_reuses_cached_blocks_and_a_failed_load_caches_nothing(engine_prompts, hf_greedy):
    p = engine_prompts
    loads = RemoteLoads()
    decode, prefill = _engine(loads), _engine("handoff")
    table, num_cached = _reserve(decode, loads, "r1", p[6])
    assert num_cached == 0 and len(table) == 11
    assert decode.cached_block_hashes() == []  # blocks waiting for remote KV are not findable
    first, _ = _prefill_into(prefill, p[6], Handoff(decode.runner.kv_pool, table, BLOCK_SIZE))
    loads.finish("r1", first)
    assert drain(decode)["r1"].token_ids == hf_greedy[6]
    assert set(block_hashes(p[6], BLOCK_SIZE, decode.prefix_salt)) <= set(decode.cached_block_hashes())

    shared, num_cached = _reserve(decode, loads, "r2", p[6][:128] + p[1])
    assert num_cached == 128 and shared[:8] == table[:8]
    before = set(decode.cached_block_hashes())
    loads.finish("r2", None)  # the load failed: its blocks are freed and it waits to be admitted again
    decode.step()
    assert set(decode.cached_block_hashes()) == before
    assert decode.abort("r2") and decode.block_manager.num_free_blocks == NUM_BLOCKS
    assert decode.prefix_salt == prefill.prefix_salt


@pytest.mark.parametrize("prefill_caches", [True, False], ids=["prefill-cached-more", "prefill-cold"])
def test_prefill_writes_exactly_the_blocks_the_destination_lacks(engine_prompts, cold, prefill_caches):
    prompt = engine_prompts[6]  # 170 tokens: 10 full blocks and a partial one
    prefill = _engine("handoff") if prefill_caches else cold
    if prefill_caches:
        _warm(prefill, prompt)  # the prefill side has 160 of its tokens cached: it copies 64..160, computes the rest
    destination = KVCache(prefill.runner.kv_spec, 16, "cpu")
    destination.buffer.fill_(0x5A)
    table = [15, 3, 9, 0, 12, 5, 1, 14, 7, 10, 2]
    held = read_blocks(destination, table[:4])  # the destination's own 64 cached tokens
    _prefill_into(prefill, prompt, Handoff(destination, table, BLOCK_SIZE, num_held_tokens=64))
    assert read_blocks(destination, table[:4]) == held  # never written: others may be reading them
    _, (reference,) = _cold_prefill(cold, prompt, slice(4, 10))
    # Bit-equal: tokens 64..160 were computed (or copied from blocks computed) by a prefill of the whole prompt in
    # one step, alone, as the cold engine computes it: the same kernels on the same shapes in the same order.
    assert torch.equal(kv_values(destination, table[4:10]), reference)


@pytest.mark.parametrize("own_cached", [0, 32, None], ids=["caching-off", "own-prefix-shorter", "caching-on"])
def test_a_prefill_reads_the_destinations_cached_prefix_instead_of_computing_it(engine_prompts, hf_greedy, cold,
                                                                                own_cached):  # fmt: skip
    prompt = engine_prompts[6]  # 170 tokens: 10 full blocks and a partial one
    loads = RemoteLoads()
    decode = _engine(loads)
    _warm(decode, prompt[:128] + engine_prompts[0])  # the destination computed the prompt's first 8 blocks
    table, num_cached = _reserve(decode, loads, "r", prompt)
    held = read_blocks(decode.runner.kv_cache, table[:8])
    prefill = _engine("handoff", enable_prefix_caching=own_cached is not None)
    if own_cached:
        _warm(prefill, prompt[:own_cached] + engine_prompts[0])  # it holds the first 2 blocks itself
    handoff = Handoff(decode.runner.kv_pool, table, BLOCK_SIZE, num_cached, readable=True)
    rid = prefill.add_request(prompt, greedy(1), kv_params=handoff)
    out = drain(prefill)[rid]
    own = own_cached or 0
    assert (num_cached, out.num_cached_tokens, out.num_external_tokens) == (128, own, 128 - own)
    own_blocks, num_own_blocks = prefill.block_manager.block_table(rid), own // BLOCK_SIZE
    imported = read_blocks(prefill.runner.kv_cache, own_blocks[num_own_blocks:8])
    assert imported == read_blocks(decode.runner.kv_cache, table[num_own_blocks:8])  # copied into its own blocks
    computed = kv_values(prefill.runner.kv_cache, own_blocks[:8])  # those it held itself: computed in another prompt
    prefill.release(rid)
    first, (prefix, tail) = _cold_prefill(cold, prompt, slice(0, 8), slice(8, 10))
    assert out.token_ids[0] == first
    # Within tolerance, not bit-equal: the destination computed the prefix inside another prompt, the tail was
    # computed over that prefix, and the cold engine computes all of it in one step of other shapes.
    assert_kv_close(kv_values(decode.runner.kv_cache, table[:8]), prefix)
    assert_kv_close(computed, prefix)
    assert_kv_close(kv_values(decode.runner.kv_cache, table[8:10]), tail)
    assert read_blocks(decode.runner.kv_cache, table[:8]) == held  # read, never written
    loads.finish("r", out.token_ids[0])
    final = drain(decode)["r"]
    assert (final.token_ids, final.num_cached_tokens) == (hf_greedy[6], 128)
    if own_cached is not None:  # its own prefix cache now serves the imported blocks
        again = prefill.add_request(prompt[:128] + engine_prompts[1], greedy(4))
        hit = drain(prefill)[again]
        assert hit.num_cached_tokens == 128 and hit.num_external_tokens == 0
        reference = cold.add_request(prompt[:128] + engine_prompts[1], greedy(4))
        assert hit.token_ids == drain(cold)[reference].token_ids


def test_a_preempted_prefill_reads_the_destinations_prefix_again(engine_prompts, cold):
    prompt = engine_prompts[6]
    loads = RemoteLoads()
    decode = _engine(loads)
    _warm(decode, prompt[:64] + engine_prompts[0])
    table, num_cached = _reserve(decode, loads, "r", prompt)
    # 12 blocks, 32 tokens a step: the prefill (11 blocks) runs beside a decoding request until the pool is full,
    # then it is preempted (the most recently admitted) and admitted again, reading the 4 blocks once more.
    # (Recomputed: a swap would bring back the blocks it read instead of reading them again; test_tiers.py checks
    # that swapped sequences give the same tokens.)
    prefill = _engine("handoff", num_blocks=12, max_num_batched_tokens=32, enable_prefix_caching=False,
                      preemption_mode="recompute")
    neighbour = prefill.add_request(engine_prompts[1], greedy(40))
    handoff = Handoff(decode.runner.kv_pool, table, BLOCK_SIZE, num_cached, readable=True)
    held = read_blocks(decode.runner.kv_cache, table[:4])
    rid = prefill.add_request(prompt, greedy(1), kv_params=handoff)
    outs = drain(prefill)
    prefill.release(rid)
    assert outs[rid].num_preemptions >= 1 and outs[rid].num_external_tokens == 64
    first, (written,) = _cold_prefill(cold, prompt, slice(4, 10))
    assert outs[rid].token_ids[0] == first
    assert read_blocks(decode.runner.kv_cache, table[:4]) == held  # read, never written
    # Within tolerance, not bit-equal: computed in chunks of 32 beside the neighbour, the cold engine's in one step.
    assert_kv_close(kv_values(decode.runner.kv_cache, table[4:10]), written)
    reference = cold.add_request(engine_prompts[1], greedy(40))
    assert outs[neighbour].token_ids == drain(cold)[reference].token_ids
    decode.abort("r")


def test_a_handoff_checks_its_held_prefix(cold):
    layers = cold.runner.kv_cache
    for bad in (8, -16):
        with pytest.raises(ValueError, match="num_held_tokens"):
            Handoff(layers, list(range(11)), BLOCK_SIZE, num_held_tokens=bad)
    with pytest.raises(ValueError, match="readable"):
        Handoff(layers, list(range(11)), BLOCK_SIZE, readable=True)


def test_a_copy_stops_layer_by_layer_at_its_deadline(monkeypatch, cold):
    """``copy_blocks`` with a deadline checks the clock before each layer: a clock that passes the deadline
    after three layers leaves the rest untouched."""
    src = KVCache(cold.runner.kv_spec, 4, "cpu")
    src.buffer.fill_(7)
    dst = KVCache(cold.runner.kv_spec, 4, "cpu")
    ticks = iter(range(100))
    monkeypatch.setattr(split_pool.time, "monotonic", lambda: next(ticks))
    assert not split_pool.copy_blocks(SplitPool([src]), [1, 2], SplitPool([dst]), [0, 3], until=3)
    written = [bool(layer.k_cache.abs().sum()) for layer in dst.layers]
    assert written == [i < 3 for i in range(len(dst.layers))]


def test_a_step_past_the_deadline_writes_nothing_there_and_caches_nothing(engine_prompts):
    engine = _engine("handoff")
    prompt = engine_prompts[5]
    dest = KVCache(engine.runner.kv_spec, 64, "cpu")
    table = list(range(engine.block_manager.num_blocks_for(len(prompt))))
    _, out = _prefill_into(engine, prompt, Handoff(dest, table, BLOCK_SIZE, deadline=time.monotonic() - 1))
    assert out.finish_reason == TRANSFER_EXPIRED and out.token_ids == []
    assert not any(layer.k_cache.abs().sum() for layer in dest.layers)
    assert engine.cached_block_hashes() == []
    assert torch.equal(dest.buffer, torch.zeros_like(dest.buffer))
