"""Block bytes and checksums: what the grpc transport carries and what both ends of every hand-off compare."""

from __future__ import annotations

import os

import pytest
import torch

from kvserve.bench.ring import rss_mib
from kvstore import KVCache, KVCacheSpec
from transfer.blocks import block_nbytes, checksum, checksum_blocks, chunked, read_blocks, write_blocks

SPEC = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32, kv_cache_dtype="int8_v")


def test_block_bytes_round_trip_exactly():
    src, dst = KVCache(SPEC, 10, "cpu"), KVCache(SPEC, 6, "cpu")
    src.buffer.copy_(torch.randint(0, 256, src.buffer.shape, dtype=torch.uint8))
    data = read_blocks(src, [7, 2, 9])
    write_blocks(dst, [0, 5, 3], data)
    assert read_blocks(dst, [0, 5, 3]) == data
    assert checksum_blocks(dst, [0, 5, 3]) == checksum_blocks(src, [7, 2, 9]) == checksum(data)
    many_src, many_dst = list(range(10)) * 2, [0, 1, 2, 3, 4, 5] * 3 + [0, 1]  # 20 blocks: two chunks
    assert checksum_blocks(src, many_src) == checksum(b"".join(read_blocks(src, c) for c in chunked(many_src)))
    assert checksum_blocks(src, many_src) != checksum_blocks(dst, many_dst)
    with pytest.raises(ValueError, match="KV chunk holds"):
        write_blocks(dst, [1], data)


def test_a_write_outside_the_pool_is_refused_and_writes_nothing():
    pool = KVCache(SPEC, 6, "cpu")
    before = read_blocks(pool, list(range(6)))
    with pytest.raises(ValueError, match=r"block ids \[6\] are outside this pool of 6 blocks"):
        write_blocks(pool, [0, 6], bytes(2 * block_nbytes(pool)))
    assert read_blocks(pool, list(range(6))) == before


def test_chunks_and_the_checksum_of_nothing():
    assert chunked(list(range(40))) == [list(range(16)), list(range(16, 32)), list(range(32, 40))]
    assert chunked([]) == [] and checksum_blocks(KVCache(SPEC, 2, "cpu"), []) == ""


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc/self/statm")
def test_a_cpu_pool_reads_zero_and_takes_memory_only_for_the_blocks_written():
    spec = KVCacheSpec(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, dtype=torch.float32)
    before = rss_mib()
    pool = KVCache(spec, 4096, "cpu")  # 512 MiB
    assert pool.buffer.numel() == spec.total_bytes(4096) >= 512 << 20
    assert rss_mib() - before < 64  # MiB; torch.zeros wrote every page at once
    write_blocks(pool, [4095], bytes(range(256)) * (block_nbytes(pool) // 256))
    assert read_blocks(pool, [0, 2048]) == bytes(2 * block_nbytes(pool))  # never written: zero
    # the bytes written, read back through the layer's view (a copy: exact)
    assert pool.layers[0].k_cache[4095].flatten().view(torch.uint8)[:3].tolist() == [0, 1, 2]
