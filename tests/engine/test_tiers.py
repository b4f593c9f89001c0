"""Memory tiers below the KV pool: the host tier's rows and LRU, the connector that moves blocks down on
eviction and back on a hit or after a swap-out, and the engine's greedy tokens through all of it."""

from __future__ import annotations

import pytest
import torch
from engine_testing import BLOCK_SIZE, greedy
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine import LLM, SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.tier_connector import TierConnector
from kvstore import BlockManager, KVCache, KVCacheSpec, block_copier
from kvstore.block_copier import BlockCopier
from kvstore.host_tier import HostTier, auto_host_bytes
from kvstore.prefix_hash import block_hashes

# -- rows: one block's bytes, every layer ------------------------------------------------------------------


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_the_copier_moves_every_byte_of_the_blocks_asked_and_nothing_else(kv_cache_dtype):
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float16,
                       kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    src, dst = KVCache(spec, 6, "cpu"), KVCache(spec, 6, "cpu")
    src.buffer.copy_(torch.randint(0, 256, (src.nbytes,), dtype=torch.uint8))  # NaN patterns included
    host = HostTier(spec, 4)
    host.cache.buffer.fill_(0xAB)  # (a new tier's memory is not cleared: its slots are written before read)
    copier = BlockCopier(torch.device("cpu"))
    copier.to_host(src.layers, [4, 1], host.views, [2, 3])
    copier.to_device(host.views, [3, 2], dst.layers, [0, 5])
    for s, d, h in zip(src.layers, dst.layers, host.views, strict=True):
        for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
            a, b, mid = getattr(s, name), getattr(d, name), getattr(h, name)
            if a is None:
                assert b is None
                continue
            assert torch.equal(mid[2].view(torch.uint8), a[4].view(torch.uint8))
            assert torch.equal(b[0].view(torch.uint8), a[1].view(torch.uint8))
            assert torch.equal(b[5].view(torch.uint8), a[4].view(torch.uint8))
            assert not b[1:5].view(torch.uint8).any() and (mid[:2].view(torch.uint8) == 0xAB).all()  # untouched


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_the_staging_path_for_scattered_slots_moves_the_same_bytes(kv_cache_dtype):
    """The GPU's path for slots in many runs (one staging buffer per call, the scatter into the slots on the
    host), run on the CPU: every region's rows land where the per-block reads of the pool say."""
    spec = KVCacheSpec(num_layers=2, num_kv_heads=3, head_dim=6, block_size=3, dtype=torch.float16,
                       kv_cache_dtype=kv_cache_dtype)  # fmt: skip (odd widths: the staging views' alignment)
    src, dst = KVCache(spec, 12, "cpu"), KVCache(spec, 12, "cpu")
    src.buffer.copy_(torch.randint(0, 256, (src.nbytes,), dtype=torch.uint8))
    host = HostTier(spec, 10)
    host.cache.buffer.fill_(0xAB)
    copier = BlockCopier(torch.device("cpu"))
    blocks, slots = [7, 2, 11, 0, 5], [9, 1, 6, 3, 0]
    assert len(block_copier._runs(slots)) > block_copier._DIRECT_MAX_RUNS
    copier._staged_to_host(src.layers, blocks, host.views, slots)
    back = [4, 10, 1, 8, 6]
    copier._staged_to_device(host.views, slots, dst.layers, back)
    for s, d, h in zip(src.layers, dst.layers, host.views, strict=True):
        for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
            a, b, mid = getattr(s, name), getattr(d, name), getattr(h, name)
            if a is None:
                continue
            for block, slot, again in zip(blocks, slots, back, strict=True):
                assert torch.equal(mid[slot].view(torch.uint8), a[block].view(torch.uint8))
                assert torch.equal(b[again].view(torch.uint8), a[block].view(torch.uint8))
            untouched = [i for i in range(10) if i not in slots]
            assert (mid[untouched].view(torch.uint8) == 0xAB).all()
            assert not b[[i for i in range(12) if i not in back]].view(torch.uint8).any()


def test_the_host_tier_evicts_least_recently_used_unpinned_entries_and_reports_net_changes():
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, block_size=2, dtype=torch.float32)
    demoted = []
    host = HostTier(spec, 3, on_evict=lambda e: demoted.append(e.block_hash))
    a, b, c = (host.add(h, "", (i,)) for i, h in enumerate("abc"))
    host.touch(a)  # order now b, c, a
    b.pins = 1
    d = host.add("d", "", (3,))
    assert demoted == ["c"] and host.lookup("c", (2,), "") is None
    assert host.lookup("b", (1,), "") is b and host.lookup("b", (9,), "") is None  # other tokens: a miss
    assert host.lookup("a", (0,), "x") is None  # another parent: a miss
    assert host.take_slots(3) is None  # b is pinned: only a and d can go
    slots = host.take_slots(2)
    assert sorted(slots) == sorted([a.slot, d.slot]) and demoted == ["c", "a", "d"]
    host.free_slots(slots)
    added, evicted = host.take_events()
    assert added == ["b"] and sorted(evicted) == []  # a, c, d came and went: no net change
    assert host.add("b", "", (5,)) is None  # a pinned entry is not replaced


# -- a miniature engine over the real scheduler, block manager and tiers -------------------------------------

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=1, block_size=2, dtype=torch.float32)


def _value(tokens: list[int], salt: int) -> float:
    """What a position's K (salt 0) or V (salt 1) must hold: a function of every token up to it, as KV is."""
    return float(hash((salt, *tokens)) % (1 << 20))


class TieredMachine(RuleBasedStateMachine):
    """Requests over a 6-block pool with prompts from a two-token alphabet (so prefixes are shared, evicted,
    found again); each step first checks that every computed position of every scheduled sequence holds the
    KV its tokens call for, then writes the new positions. A block a tier lost or served for other tokens
    fails that check."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = KVCache(SPEC, 6, "cpu")
        self.bm = BlockManager(6, SPEC.block_size, enable_caching=True, salt="t", record_evictions=True)
        self.host = HostTier(SPEC, 5)
        self.tiers = TierConnector(self.bm, self.pool.layers, self.host, BlockCopier(torch.device("cpu")),
                                   preemption_mode="swap")  # fmt: skip
        self.scheduler = Scheduler(self.bm, max_num_seqs=3, max_num_batched_tokens=5, connector=self.tiers)
        self.live: dict[str, Sequence] = {}
        self.count = 0

    def _slot(self, seq: Sequence, pos: int) -> tuple[int, int]:
        return int(seq.block_table[pos // SPEC.block_size]), pos % SPEC.block_size

    @rule(prompt=st.lists(st.integers(0, 1), min_size=1, max_size=9), max_tokens=st.integers(1, 4))
    def add(self, prompt, max_tokens):
        self.count += 1
        seq = Sequence(f"s{self.count}", prompt, SamplingParams(max_tokens=max_tokens), None)
        self.live[seq.seq_id] = seq
        self.scheduler.add(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        seq = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.scheduler.finish(seq, "abort")

    @rule()
    def step(self):
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return
        self.tiers.start_loads(batch.admitted)
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            for pos in range(seq.num_computed_tokens + n):
                block, offset = self._slot(seq, pos)
                k, v = self.pool.layers[1].k_cache, self.pool.layers[0].v_cache
                if pos < seq.num_computed_tokens:
                    assert k[block, offset, 0, 0].item() == _value(seq.token_ids[: pos + 1], 0), (seq.seq_id, pos)
                    assert v[block, offset, 0, 0].item() == _value(seq.token_ids[: pos + 1], 1), (seq.seq_id, pos)
                else:
                    for layer in self.pool.layers:
                        layer.k_cache[block, offset] = _value(seq.token_ids[: pos + 1], 0)
                        layer.v_cache[block, offset] = _value(seq.token_ids[: pos + 1], 1)
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
            self.bm.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(sum(seq.token_ids) % 2)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    self.scheduler.finish(seq, "length")
                    del self.live[seq.seq_id]

    @invariant()
    def every_row_is_free_cached_or_swapped_exactly_once(self):
        swapped = [s for slots, _ in self.tiers._swapped.values() for s in slots]
        used = [e.slot for e in self.host.entries.values()] + swapped + self.host._free
        assert sorted(used) == list(range(self.host.num_slots))
        assert all(e.pins == 0 for e in self.host.entries.values())  # no plan outlives its admission

    def teardown(self):
        for seq in list(self.live.values()):
            self.scheduler.finish(seq, "abort")
        assert not self.tiers._swapped and self.host.num_free_slots + len(self.host.entries) == self.host.num_slots


TestTieredMachine = TieredMachine.TestCase
TestTieredMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# -- the engine: greedy tokens through the tiers equal tokens computed from scratch ------------------------


def _outputs(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list:
    return [llm.generate([p], params)[0] for p in prompts]


def _long_prompts(engine_prompts) -> list[list[int]]:
    """Four prompts of 9 blocks and a token, no two sharing a first block."""
    text = engine_prompts[6] + engine_prompts[5]
    return [text[i : i + 9 * BLOCK_SIZE + 1] for i in (0, 30, 60, 90)]


@pytest.fixture(scope="module")
def long_answers(engine_prompts) -> tuple[list[list[int]], list[list[int]]]:
    """``_long_prompts`` and their greedy(8) answers, each computed alone in a pool that holds them all, with
    no prefix cache and no tier."""
    prompts = _long_prompts(engine_prompts)
    cold = LLM("default", block_size=BLOCK_SIZE, num_blocks=64, enable_prefix_caching=False)
    return prompts, [o.token_ids for o in _outputs(cold, prompts, greedy(8))]


def test_blocks_the_pool_evicted_come_back_from_the_host_tier_token_exact(long_answers):
    prompts, want = long_answers  # 4 x 10 blocks through a 24-block pool
    tiered = LLM("default", block_size=BLOCK_SIZE, num_blocks=24, host_kv_cache_gb=0.05)
    params = greedy(8)
    first = _outputs(tiered, prompts, params)
    again = _outputs(tiered, prompts, params)  # the first prompt's blocks were evicted by the three after it
    assert [o.token_ids for o in first] == want and [o.token_ids for o in again] == want
    assert again[0].num_cached_tokens == 0 and again[0].num_external_tokens == 9 * BLOCK_SIZE
    assert all(o.num_cached_tokens + o.num_external_tokens == 9 * BLOCK_SIZE for o in again)  # no recompute
    stats = tiered.engine.tiers.stats
    assert stats.hit_tokens["host"] == sum(o.num_external_tokens for o in again) and stats.blocks_loaded > 0


@pytest.fixture(scope="module")
def unpreempted(engine_prompts) -> tuple[list[list[int]], SamplingParams, list[list[int]]]:
    """Two sequences of 10 blocks growing to 11 each: a 20-block pool must preempt one; a 64-block one not."""
    prompts, params = [p[:150] for p in _long_prompts(engine_prompts)[:2]], greedy(26)
    big = LLM("default", block_size=BLOCK_SIZE, num_blocks=64)
    return prompts, params, [o.token_ids for o in big.generate(prompts, params)]


@pytest.mark.parametrize(("mode", "caching"), [("swap", False), ("recompute", False), ("swap", True)])
def test_swapped_out_and_recomputed_sequences_give_the_tokens_of_an_unpreempted_run(unpreempted, mode, caching):
    prompts, params, want = unpreempted
    llm = LLM("default", block_size=BLOCK_SIZE, num_blocks=20, host_kv_cache_gb=0.05, preemption_mode=mode,
              enable_prefix_caching=caching, max_num_batched_tokens=512)  # fmt: skip
    outs = llm.generate(prompts, params)
    stats, host = llm.engine.tiers.stats, llm.engine.tiers.host
    assert [o.token_ids for o in outs] == want
    assert sum(o.num_preemptions for o in outs) == stats.swapped_out + stats.recomputed >= 1
    if mode == "recompute":
        assert stats.swapped_out == 0 and stats.blocks_loaded == 0
    elif caching:  # its full blocks stayed cached in the pool: only the partial last block came from the swap
        assert stats.recomputed == 0 and stats.blocks_loaded >= 1
    else:  # every block it had came back from the host tier
        assert stats.recomputed == 0 and stats.blocks_loaded >= 10
    assert host.num_free_slots + len(host.entries) == host.num_slots  # every swap row came back


def test_tier_settings_a_person_can_act_on(tmp_path):
    with pytest.raises(ValueError, match="available memory"):
        LLM("default", num_blocks=8, host_kv_cache_gb=1 << 20)
    with pytest.raises(ValueError, match="holds no block"):
        LLM("default", num_blocks=8, host_kv_cache_gb=1e-9)
    with pytest.raises(ValueError, match="needs a host tier"):
        LLM("default", num_blocks=8, host_kv_cache_gb=0, disk_kv_cache_dir=str(tmp_path / "kv"), disk_kv_cache_gb=0.1)


def test_the_host_tier_is_on_by_default_at_twice_the_pool_within_the_hosts_memory():
    engine = LLM("default", num_blocks=8).engine
    assert engine.tiers is not None and engine.tiers.host.num_slots == 16  # twice the 8-block pool
    engine.close()
    assert LLM("default", num_blocks=8, host_kv_cache_gb=0).engine.tiers is None
    gib = 1 << 30
    assert auto_host_bytes(1 * gib, 64 * gib) == 2 * gib
    assert auto_host_bytes(8 * gib, 64 * gib) == 4 * gib  # capped per worker
    assert auto_host_bytes(1 * gib, 4 * gib) == 1 * gib  # a quarter of what the host has left
    assert auto_host_bytes(1 * gib, None) == 2 * gib


# -- on a GPU: the copy stream, pinned slots, and the engine's tokens -------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("slots", [[0, 1, 2, 9, 10], [20, 3, 17, 11, 29]], ids=["two-runs", "scattered"])
def test_on_a_gpu_blocks_cross_the_copy_stream_byte_exact_behind_the_compute_stream(slots, monkeypatch):
    monkeypatch.setattr(block_copier, "_DIRECT_MIN_BYTES", 0)  # two runs: straight into the slots, however few
    spec = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16,
                       kv_cache_dtype="int8_v")  # fmt: skip
    cuda = torch.device("cuda")
    pool, back = KVCache(spec, 64, cuda), KVCache(spec, 64, cuda)
    host, copier = HostTier(spec, 32, pin_memory=True), BlockCopier(cuda)
    assert host.cache.buffer.is_pinned()
    pool.buffer.copy_(torch.randint(0, 256, (pool.nbytes,), dtype=torch.uint8, device=cuda))
    expected = pool.buffer.clone()
    blocks = [5, 60, 7, 8, 33]  # into two runs of slots (a copy per run), or five (through the staging buffer)
    copier.to_host(pool.layers, blocks, host.views, slots)
    copier.wait_for_copies()  # what the engine does before a step writes the pool
    pool.buffer.zero_()  # on the compute stream: ordered after the copy, which must not see it
    copier.synchronize()
    copier.to_device(host.views, slots, back.layers, blocks)
    copier.wait_for_copies()
    got = back.buffer.clone()  # ordered after the load by wait_for_copies
    torch.cuda.synchronize()
    original = KVCache(spec, 64, cuda, buffer=expected)
    for want, have in zip(original.layers, KVCache(spec, 64, cuda, buffer=got).layers, strict=True):
        assert torch.equal(want.k_cache[blocks].view(torch.uint8), have.k_cache[blocks].view(torch.uint8))
        # as bytes: random bytes read as floats hold NaNs, which torch.equal never finds equal
        assert torch.equal(want.v_scale[blocks].view(torch.uint8), have.v_scale[blocks].view(torch.uint8))


@pytest.mark.gpu
def test_on_a_gpu_host_tier_hits_and_swaps_give_the_tokens_of_a_pool_that_holds_everything(tmp_path):
    import random

    from kvserve.testing.random_model import write_random_model

    model = write_random_model(tmp_path / "qwen2", "qwen2-0.5b", num_layers=4, device="cuda")
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 150000) for _ in range(200)] for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    common = {"device": "cuda", "skip_tokenizer_init": True, "block_size": 16}
    want = [o.token_ids for o in LLM(str(model), num_blocks=256, **common).generate(prompts, params)]
    small = LLM(str(model), num_blocks=30, host_kv_cache_gb=0.25, preemption_mode="swap", **common)
    # two sequences of 13 blocks fit the 30-block pool; growing to 18 each, one of them must be swapped out
    # (with 40 new tokens they grew to 15 each, filled the pool exactly, and nothing was swapped: the H200 run)
    assert [o.token_ids for o in small.generate(prompts, params)] == want
    again = _outputs(small, prompts, params)  # one at a time: evicted prefixes come back from the host tier
    assert [o.token_ids for o in again] == want
    stats = small.engine.tiers.stats
    assert stats.swapped_out >= 1 and stats.hit_tokens["host"] > 0 and stats.blocks_loaded > 0


def test_blocks_come_back_from_the_disk_tier_and_survive_a_restart_and_a_corrupt_file_is_recomputed(
        long_answers, tmp_path):  # fmt: skip
    prompts, want = long_answers
    tiny_host = 10 * 737280 / (1 << 30)  # 10 blocks: one prompt's, so most of what the pool evicts goes to disk
    options = {"block_size": BLOCK_SIZE, "num_blocks": 24, "host_kv_cache_gb": tiny_host,
               "disk_kv_cache_dir": str(tmp_path / "kv"), "disk_kv_cache_gb": 0.1}  # fmt: skip
    params = greedy(8)
    first = LLM("default", **options)
    assert [o.token_ids for o in _outputs(first, prompts, params)] == want
    again = _outputs(first, prompts[:1], params)[0]  # its blocks went pool -> host -> disk
    assert again.token_ids == want[0] and again.num_external_tokens == 9 * BLOCK_SIZE
    assert first.engine.tiers.stats.hit_tokens["disk"] >= 2 * BLOCK_SIZE
    on_disk = set(first.engine.held_block_hashes()["disk"])
    first.engine.close()  # the disk tier's writes are flushed
    restarted = LLM("default", **options)
    assert set(restarted.engine.held_block_hashes()["disk"]) == on_disk  # what a restarted worker re-announces
    chains = [block_hashes(p, BLOCK_SIZE, restarted.engine.prefix_salt) for p in prompts]
    victim = next(chain for chain in chains if set(chain[:3]) <= on_disk)
    path = next(f for f in (tmp_path / "kv").rglob(victim[1]) if f.is_file())
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the payload's last byte: only the checksum can tell
    path.write_bytes(bytes(data))
    outs = _outputs(restarted, prompts, params)
    assert [o.token_ids for o in outs] == want  # the corrupt block was recomputed, never served
    assert outs[chains.index(victim)].num_external_tokens == BLOCK_SIZE  # the block before it came from disk
    stats = restarted.engine.tiers.stats
    assert stats.hit_tokens["disk"] >= BLOCK_SIZE and stats.corrupt == 1
    restarted.engine.tiers.disk.flush()
    assert not path.exists()  # the corrupt file is gone
    restarted.engine.close()


def test_a_disk_tier_in_a_directory_that_cannot_be_made_is_refused_at_start(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="disk_kv_cache_dir"):
        LLM("default", num_blocks=8, host_kv_cache_gb=0.01, disk_kv_cache_dir=str(blocker / "kv"), disk_kv_cache_gb=0.1)
