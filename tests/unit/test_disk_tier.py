"""``kvstore.disk_tier``: blocks round-trip byte-exact through files for every pool layout, a corrupt, truncated
or mismatched file is deleted and never served, the tier survives a restart, evicts least recently used first,
reports net stored/evicted events, and ``store`` does not wait for the disk. Bytes read back are compared with
the source pool's block read straight from its views, not through the tier."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
import threading

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore import disk_format
from kvstore.disk_format import bytes_per_file
from kvstore.disk_tier import DiskTier
from kvstore.kv_cache import KVCache, KVCacheSpec
from kvstore.layout import fingerprint
from kvstore.prefix_hash import block_hashes

BLOCK_SIZE = 4
SPECS = {
    "auto-float32": KVCacheSpec(2, 2, 8, BLOCK_SIZE, torch.float32),
    "auto-bfloat16": KVCacheSpec(2, 2, 8, BLOCK_SIZE, torch.bfloat16),
    "int8_v-float16": KVCacheSpec(2, 2, 8, BLOCK_SIZE, torch.float16, "int8_v"),
    "int8-bfloat16": KVCacheSpec(2, 2, 8, BLOCK_SIZE, torch.bfloat16, "int8"),
}
SPEC = SPECS["int8-bfloat16"]  # K, V and both scale regions
FP = fingerprint("TestForCausalLM", SPEC)


def _chain(n: int, first_token: int = 100, salt: str = FP) -> list[tuple[str, tuple[int, ...], str]]:
    """(hash, token ids, parent hash) of the ``n`` blocks of one sequence."""
    ids = list(range(first_token, first_token + n * BLOCK_SIZE))
    hashes = block_hashes(ids, BLOCK_SIZE, salt)
    return [(h, tuple(ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]), hashes[i - 1] if i else "")
            for i, h in enumerate(hashes)]  # fmt: skip


def _pool(spec: KVCacheSpec, num_blocks: int, seed: int | None = None) -> KVCache:
    """A CPU pool, zeros or (with ``seed``) random bytes in every region."""
    cache = KVCache(spec, num_blocks, "cpu")
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        cache.buffer.copy_(torch.randint(0, 256, (cache.nbytes,), dtype=torch.uint8, generator=generator))
    return cache


def _block(cache: KVCache, block_id: int) -> bytes:
    """Block ``block_id``'s bytes read from each layer's K, V and scale views."""
    views = [getattr(layer, name) for layer in cache.layers for name in ("k_cache", "v_cache", "k_scale", "v_scale")]
    return b"".join(v[block_id].contiguous().view(torch.uint8).numpy().tobytes() for v in views if v is not None)


def _path(tier: DiskTier, block_hash: str):
    return tier.root / block_hash[:2] / block_hash


@pytest.fixture
def open_tier(tmp_path):
    """Opens tiers (in ``tmp_path`` with the test layout unless told otherwise) and closes them afterwards."""
    tiers = []

    def open_(directory=tmp_path, fp=FP, capacity_blocks=16, spec=SPEC) -> DiskTier:
        tier = DiskTier(directory, fp, capacity_blocks * bytes_per_file(fp, spec), spec)
        tiers.append(tier)
        return tier

    yield open_
    for tier in tiers:
        tier.close()


@pytest.mark.parametrize("name", SPECS)
def test_blocks_round_trip_byte_exact_through_a_restart(open_tier, name):
    spec = SPECS[name]
    fp = fingerprint("TestForCausalLM", spec)
    src, dst = _pool(spec, 3, seed=1), _pool(spec, 4)
    (h0, t0, p0), (h1, t1, p1) = _chain(2, salt=fp)
    tier = open_tier(fp=fp, spec=spec)
    assert tier.store(h0, p0, t0, src, 2) and tier.store(h1, p1, t1, src, 0)
    tier.close()
    assert _path(tier, h0).stat().st_size <= bytes_per_file(fp, spec)

    reopened = open_tier(fp=fp, spec=spec)  # so the bytes come from the files
    assert reopened.load(h0, t0, p0, dst, 1) and reopened.load(h1, t1, p1, dst, 3)
    assert _block(dst, 1) == _block(src, 2) and _block(dst, 3) == _block(src, 0)
    assert _block(dst, 0) == _block(dst, 2) == bytes(len(_block(src, 0)))  # other blocks untouched


def test_store_copies_at_once_and_does_not_wait_for_the_disk(open_tier, monkeypatch):
    tier = open_tier()
    src, dst = _pool(SPEC, 2, seed=2), _pool(SPEC, 2)
    (h0, t0, p0), (h1, t1, p1) = _chain(2)
    expected = _block(src, 0)
    writing, gate = threading.Event(), threading.Event()
    write_file = disk_format.write_block_file

    def slow_disk(*args):
        writing.set()
        gate.wait(10)
        write_file(*args)

    monkeypatch.setattr(disk_format, "write_block_file", slow_disk)
    try:
        assert tier.store(h0, p0, t0, src, 0)
        assert tier.store(h1, p1, t1, src, 1)  # returns although the writer is stuck on the first
        assert writing.wait(5) and not gate.is_set()
        src.buffer.zero_()  # the caller reuses the slots right away
        assert tier.lookup(h0, t0, p0) and not _path(tier, h0).exists()
        assert tier.load(h0, t0, p0, dst, 1)  # served from the queued bytes
        assert _block(dst, 1) == expected
    finally:
        gate.set()
    tier.flush()
    assert _path(tier, h0).exists() and _path(tier, h1).exists()
    dst.buffer.zero_()
    assert tier.load(h0, t0, p0, dst, 0) and _block(dst, 0) == expected


def _flip_last_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_corrupt_payload_is_deleted_never_served(open_tier, caplog):
    tier = open_tier()
    src, dst = _pool(SPEC, 1, seed=3), _pool(SPEC, 1)
    [(h, t, p)] = _chain(1)
    tier.store(h, p, t, src, 0)
    tier.flush()
    assert tier.take_events() == ([h], [])
    _flip_last_byte(_path(tier, h))
    with caplog.at_level(logging.WARNING, logger="kvstore.disk_tier"):
        assert not tier.load(h, t, p, dst, 0)
    assert "checksum mismatch" in caplog.text
    assert _block(dst, 0) == bytes(len(_block(src, 0)))
    tier.flush()
    assert not _path(tier, h).exists() and not tier.contains(h)
    assert tier.take_events() == ([], [h])


@pytest.mark.parametrize("other", ["tokens", "parent"])
def test_a_file_naming_other_tokens_or_parent_is_deleted_never_served(open_tier, tmp_path, other):
    src, dst = _pool(SPEC, 1, seed=4), _pool(SPEC, 1)
    [_, (h, t, p)] = _chain(2)
    tier = open_tier(tmp_path / "a")
    forger = open_tier(tmp_path / "b")  # the same block hash over other tokens, or after another parent
    tier.store(h, p, t, src, 0)
    forged_tokens, forged_parent = ((*t[:-1], t[-1] + 1), p) if other == "tokens" else (t, h)
    forger.store(h, forged_parent, forged_tokens, src, 0)
    tier.flush()
    forger.flush()
    shutil.copyfile(_path(forger, h), _path(tier, h))
    assert tier.lookup(h, t, p)  # the index still holds the right tokens: only the file lies
    assert not tier.load(h, t, p, dst, 0)
    tier.flush()
    assert not _path(tier, h).exists() and not tier.contains(h)
    assert _block(dst, 0) == bytes(len(_block(src, 0)))


def test_files_of_another_layout_are_ignored(open_tier, tmp_path):
    src, dst = _pool(SPEC, 1, seed=5), _pool(SPEC, 1)
    [(h, t, p)] = _chain(1)
    ours = open_tier()
    ours.store(h, p, t, src, 0)
    ours.close()
    theirs = open_tier(fp="feedfacefeedface")  # another layout in the same directory
    assert theirs.hashes() == [] and not theirs.load(h, t, p, dst, 0)
    theirs.close()
    _path(theirs, h).parent.mkdir()
    shutil.copyfile(_path(ours, h), _path(theirs, h))  # a file moved between layouts' directories
    assert open_tier(fp="feedfacefeedface").hashes() == []
    assert not _path(theirs, h).exists() and _path(ours, h).exists()
    assert open_tier().hashes() == [h]


def test_a_truncated_file_is_a_miss_at_load_and_dropped_at_restart(open_tier):
    src, dst = _pool(SPEC, 2, seed=6), _pool(SPEC, 1)
    (h0, t0, p0), (h1, t1, p1) = _chain(2)
    tier = open_tier()
    tier.store(h0, p0, t0, src, 0)
    tier.store(h1, p1, t1, src, 1)
    tier.flush()
    for h in (h0, h1):
        os.truncate(_path(tier, h), _path(tier, h).stat().st_size - 1)
    assert not tier.load(h0, t0, p0, dst, 0)
    tier.close()
    assert not _path(tier, h0).exists()
    assert open_tier().hashes() == [] and not _path(tier, h1).exists()


def test_a_restart_reannounces_blocks_in_lru_order_and_cleans_up(open_tier):
    src, dst = _pool(SPEC, 3, seed=7), _pool(SPEC, 1)
    blocks = _chain(3)
    tier = open_tier()
    for i, (h, t, p) in enumerate(blocks):
        tier.store(h, p, t, src, i)
    tier.close()
    for age, (h, _, _) in zip([20, 30, 10], blocks, strict=True):  # least recently used: block 2, then 0, 1
        os.utime(_path(tier, h), (1e9 + age, 1e9 + age))
    shard = _path(tier, blocks[0][0]).parent
    (shard / ".tmp-interrupted").write_bytes(b"half a block")
    junk = shard / (blocks[0][0][:2] + "0" * 30)
    junk.write_bytes(b"not a block")

    reopened = open_tier()
    lru = [blocks[2][0], blocks[0][0], blocks[1][0]]
    assert reopened.hashes() == lru and reopened.take_events() == (lru, [])
    assert not (shard / ".tmp-interrupted").exists() and not junk.exists()
    for i, (h, t, p) in enumerate(blocks):
        assert reopened.load(h, t, p, dst, 0) and _block(dst, 0) == _block(src, i)
    reopened.close()
    assert all(_path(tier, h).stat().st_mtime > 1e9 + 30 for h, _, _ in blocks)  # a load touches the file

    for age, (h, _, _) in zip([10, 30, 20], blocks, strict=True):
        os.utime(_path(tier, h), (1e9 + age, 1e9 + age))
    smaller = open_tier(capacity_blocks=2)  # trimmed to capacity, least recently used first
    assert smaller.hashes() == [blocks[2][0], blocks[1][0]] and smaller.take_events() == (smaller.hashes(), [])
    smaller.flush()
    assert not _path(tier, blocks[0][0]).exists()


def test_capacity_evicts_least_recently_used_and_events_are_net(open_tier):
    src, dst = _pool(SPEC, 5, seed=8), _pool(SPEC, 1)
    (ha, ta, pa), (hb, tb, pb), (hc, tc, pc), (hd, td, pd), (he, te, pe) = _chain(5)
    tier = open_tier(capacity_blocks=3)
    for i, (h, t, p) in enumerate([(ha, ta, pa), (hb, tb, pb), (hc, tc, pc)]):
        tier.store(h, p, t, src, i)
    assert tier.take_events() == ([ha, hb, hc], [])
    assert tier.load(ha, ta, pa, dst, 0)  # a load keeps a
    assert tier.store(hb, pb, tb, src, 4)  # held already: touched, not rewritten
    assert tier.load(hb, tb, pb, dst, 0) and _block(dst, 0) == _block(src, 1)
    tier.store(hd, pd, td, src, 3)
    tier.flush()
    assert tier.hashes() == [ha, hb, hd] and not _path(tier, hc).exists()
    assert tier.used_bytes <= tier.capacity_bytes
    tier.store(hc, pc, tc, src, 2)  # evicts a; c was evicted and stored again since the last take
    tier.store(he, pe, te, src, 4)  # evicts b
    tier.flush()
    assert tier.hashes() == [hd, hc, he]
    assert tier.take_events() == ([hd, he], [ha, hb])
    assert tier.take_events() == ([], [])
    assert tier.load(hb, tb, pb, dst, 0) is False
    assert tier.load(hc, tc, pc, dst, 0) and _block(dst, 0) == _block(src, 2)
    files = [p for p in tier.root.rglob("*") if p.is_file()]
    assert sorted(p.name for p in files) == sorted([hd, hc, he])
    assert tier.used_bytes == sum(p.stat().st_size for p in files)


def test_a_failed_write_drops_the_block(open_tier, monkeypatch):
    tier = open_tier()
    [(h, t, p)] = _chain(1)

    def full_disk(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_format, "write_block_file", full_disk)
    tier.store(h, p, t, _pool(SPEC, 1, seed=9), 0)
    tier.flush()
    assert not tier.contains(h) and tier.used_bytes == 0 and tier.take_events() == ([], [])


def test_start_up_refuses_what_cannot_work(tmp_path):
    regular_file = tmp_path / "a-file"
    regular_file.write_text("x")
    one_block = bytes_per_file(FP, SPEC)
    with pytest.raises(ValueError, match="cannot be created.*disk_kv_cache_dir"):
        DiskTier(regular_file / "kv", FP, one_block, SPEC)
    with pytest.raises(ValueError, match="less than one block.*disk_kv_cache_gb"):
        DiskTier(tmp_path, FP, one_block - 1, SPEC)
    with pytest.raises(ValueError, match="more than the filesystem.*disk_kv_cache_gb"):
        DiskTier(tmp_path, FP, shutil.disk_usage(tmp_path).free + (1 << 50), SPEC)
    with pytest.raises(ValueError, match="cannot name a directory"):
        DiskTier(tmp_path, "../elsewhere", one_block, SPEC)


MACHINE_BLOCKS = _chain(4)
MACHINE_CAPACITY_BLOCKS = 3


class DiskTierMachine(RuleBasedStateMachine):
    """Stores, loads (right and wrong tokens), flushes, byte flips anywhere in a file and restarts, against a
    model of the bytes each held block must load as: a load never serves other bytes, and a held block that
    was not corrupted always loads."""

    def __init__(self):
        super().__init__()
        self.directory = tempfile.mkdtemp(prefix="disk-tier-")
        self.capacity = MACHINE_CAPACITY_BLOCKS * bytes_per_file(FP, SPEC)
        self.tier = DiskTier(self.directory, FP, self.capacity, SPEC)
        self.src, self.dst = _pool(SPEC, 1), _pool(SPEC, 2)
        self.zeros = _block(self.dst, 0)
        self.expected: dict[str, bytes] = {}
        self.written: dict[str, bytes] = {}  # a held block's file as the tier wrote it, once a test flipped it
        self.announced: set[str] = set()

    def corrupt(self) -> set[str]:
        """Held blocks whose file differs from what the tier wrote (two flips can undo each other)."""
        return {
            h for h, data in self.written.items() if self.tier.contains(h) and _path(self.tier, h).read_bytes() != data
        }

    def teardown(self):
        self.tier.close()
        shutil.rmtree(self.directory)

    @rule(i=st.integers(0, len(MACHINE_BLOCKS) - 1), seed=st.integers(0, 1 << 16))
    def store(self, i, seed):
        h, t, p = MACHINE_BLOCKS[i]
        generator = torch.Generator().manual_seed(seed)
        self.src.buffer.copy_(torch.randint(0, 256, (self.src.nbytes,), dtype=torch.uint8, generator=generator))
        held = self.tier.contains(h)
        assert self.tier.store(h, p, t, self.src, 0)
        if not held:
            self.expected[h] = _block(self.src, 0)
            self.written.pop(h, None)

    @rule(i=st.integers(0, len(MACHINE_BLOCKS) - 1), wrong_tokens=st.booleans())
    def load(self, i, wrong_tokens):
        self._load(*MACHINE_BLOCKS[i], wrong_tokens)

    @precondition(lambda self: len(self.tier))
    @rule(data=st.data())
    def load_a_held_block(self, data):
        h = data.draw(st.sampled_from(sorted(self.tier.hashes())))
        self._load(*next(block for block in MACHINE_BLOCKS if block[0] == h), wrong_tokens=False)

    def _load(self, h, t, p, wrong_tokens):
        if wrong_tokens:
            t = (*t[:-1], t[-1] + 1)
        held, corrupt = self.tier.contains(h), h in self.corrupt()
        self.dst.buffer.zero_()
        served = self.tier.load(h, t, p, self.dst, 1)
        assert _block(self.dst, 0) == self.zeros
        if served:
            assert not wrong_tokens and not corrupt
            assert _block(self.dst, 1) == self.expected[h]
        else:
            assert _block(self.dst, 1) == self.zeros
            assert wrong_tokens or not held or corrupt

    @rule()
    def flush(self):
        self.tier.flush()

    @precondition(lambda self: len(self.tier))
    @rule(data=st.data())
    def flip_a_byte(self, data):
        self.tier.flush()
        h = data.draw(st.sampled_from(sorted(self.tier.hashes())))
        path = _path(self.tier, h)
        contents = bytearray(path.read_bytes())
        self.written.setdefault(h, bytes(contents))
        rng = data.draw(st.randoms(use_true_random=False))  # uniform offsets: st.integers favours the ends
        header_bytes = len(contents) - SPEC.bytes_per_block()  # half the flips land in the header
        offset = rng.randrange(header_bytes) if rng.random() < 0.5 else rng.randrange(len(contents))
        contents[offset] ^= rng.randrange(1, 256)
        path.write_bytes(bytes(contents))

    @rule()
    def restart(self):
        before, corrupt = set(self.tier.hashes()), self.corrupt()
        self.tier.close()
        self.tier = DiskTier(self.directory, FP, self.capacity, SPEC)
        after = set(self.tier.hashes())
        assert after <= before and before - after <= corrupt  # only a corrupt header drops a file
        stored, evicted = self.tier.take_events()
        assert set(stored) == after and evicted == []
        self.announced = after

    @invariant()
    def events_track_the_held_set(self):
        stored, evicted = self.tier.take_events()
        assert not set(stored) & self.announced and set(evicted) <= self.announced
        self.announced = (self.announced - set(evicted)) | set(stored)
        assert self.announced == set(self.tier.hashes()) <= set(self.expected)
        assert self.tier.used_bytes <= self.capacity


DiskTierMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
test_disk_tier_machine = DiskTierMachine.TestCase
