"""A pool split over tensor-parallel ranks by KV heads (``kvstore.split_pool``), against the unsplit pool it was cut
from by plain slicing: its hand-off bytes and checksum are the unsplit pool's, and blocks copied or written into
another split land as that pool's heads. Float32 and an INT8 cache (whose scales split by heads too); splits
of the bundled model's 3 KV heads over 1, 2 and 3 ranks. And the ``shm`` transport opening a destination split
over rank files, or refusing a layout it cannot map."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from service_utils import TEST_SECURITY

from kvstore import KVCache, KVCacheSpec
from kvstore.shared_pool import SHM_DIR_ENV, create_part_files, create_shared_pool, map_pool_file
from kvstore.split_pool import SplitPool, copy_blocks
from protos.kvserve.v1 import kvserve_pb2 as pb
from transfer.blocks import checksum_blocks, read_blocks, write_blocks
from transfer.cuda_ipc import CudaIpcTransport
from transfer.interface import Origin
from transfer.shm import ShmTransport

SPECS = [KVCacheSpec(num_layers=2, num_kv_heads=3, head_dim=8, block_size=4, dtype=torch.float32),
         KVCacheSpec(num_layers=2, num_kv_heads=3, head_dim=8, block_size=4, dtype=torch.float32,
                     kv_cache_dtype="int8")]  # fmt: skip
NUM_BLOCKS = 12


def _whole(spec: KVCacheSpec, seed: int) -> KVCache:
    pool = KVCache(spec, NUM_BLOCKS, "cpu")
    pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, generator=torch.Generator().manual_seed(seed),
                                    dtype=torch.uint8))  # fmt: skip
    return pool


def _empty_split(spec: KVCacheSpec, heads: list[int]) -> SplitPool:
    return SplitPool([KVCache(dataclasses.replace(spec, num_kv_heads=h), NUM_BLOCKS, "cpu") for h in heads])


def _cut(whole: KVCache, heads: list[int]) -> SplitPool:
    """``whole`` split by heads, each part filled by slicing the whole pool's regions (dim 2 holds the heads)."""
    split = _empty_split(whole.spec, heads)
    for part, first, n in zip(split.parts, split.firsts, split.heads, strict=True):
        for mine, theirs in zip(part.layers, whole.layers, strict=True):
            for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
                if getattr(theirs, name) is not None:
                    getattr(mine, name).copy_(getattr(theirs, name)[:, :, first : first + n])
    return split


def _assert_holds(split: SplitPool, blocks: list[int], whole: KVCache, whole_blocks: list[int]) -> None:
    """Each part's ``blocks`` hold ``whole``'s heads of ``whole_blocks``, byte for byte."""
    for part, first, n in zip(split.parts, split.firsts, split.heads, strict=True):
        for mine, theirs in zip(part.layers, whole.layers, strict=True):
            for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
                if getattr(theirs, name) is not None:
                    got = getattr(mine, name)[blocks].view(torch.uint8)
                    want = getattr(theirs, name)[whole_blocks][:, :, first : first + n].contiguous().view(torch.uint8)
                    assert torch.equal(got, want), (name, split.heads)


@pytest.mark.parametrize("spec", SPECS, ids=["float32", "int8"])
@pytest.mark.parametrize("heads", [[3], [2, 1], [1, 1, 1]])
def test_a_split_pools_bytes_and_checksum_are_the_unsplit_pools(spec, heads):
    whole = _whole(spec, 0)
    split = _cut(whole, heads)
    blocks = [9, 2, 3, 4, 0]
    assert split.spec == whole.spec and split.layout == ",".join(map(str, heads))
    assert read_blocks(split, blocks) == read_blocks(whole, blocks)
    assert checksum_blocks(split, blocks) == checksum_blocks(whole, blocks)
    assert checksum_blocks(split, blocks) != checksum_blocks(whole, [9, 2, 3, 4, 1])


@pytest.mark.parametrize("spec", SPECS, ids=["float32", "int8"])
@pytest.mark.parametrize(("src_heads", "dst_heads"), [([2, 1], [3]), ([3], [2, 1]), ([2, 1], [1, 1, 1]),
                                                      ([1, 1, 1], [2, 1])])  # fmt: skip
def test_blocks_copied_or_written_across_splits_land_as_whole_heads(spec, src_heads, dst_heads):
    whole = _whole(spec, 1)
    source = _cut(whole, src_heads)
    src_blocks, dst_blocks = [1, 7, 8, 11], [0, 5, 6, 10]
    copied = _empty_split(spec, dst_heads)
    assert copy_blocks(source, src_blocks, copied, dst_blocks)
    _assert_holds(copied, dst_blocks, whole, src_blocks)
    untouched = [b for b in range(NUM_BLOCKS) if b not in dst_blocks]
    for part in copied.parts:
        assert not any(layer.k_cache[untouched].view(torch.uint8).any() for layer in part.layers)
    written = _empty_split(spec, dst_heads)
    write_blocks(written, dst_blocks, read_blocks(source, src_blocks))  # the grpc stream's bytes
    _assert_holds(written, dst_blocks, whole, src_blocks)
    assert checksum_blocks(written, dst_blocks) == checksum_blocks(whole, src_blocks)


def test_splits_of_different_models_are_refused():
    other = dataclasses.replace(SPECS[0], head_dim=16)
    with pytest.raises(ValueError, match="KV layouts differ"):
        copy_blocks(_cut(_whole(SPECS[0], 2), [2, 1]), [0], _empty_split(other, [2, 1]), [0])
    with pytest.raises(ValueError, match="differ in their KV heads only"):
        SplitPool([KVCache(SPECS[0], NUM_BLOCKS, "cpu"), KVCache(other, NUM_BLOCKS, "cpu")])


def test_shm_opens_a_destination_split_over_rank_files(tmp_path, monkeypatch):
    """A decode worker at TP=2 (heads 2 + 1): part 0 is its pool file, part 1 the rank's file beside it; the
    prefill worker maps both with their heads, and what it writes into them is the decode worker's memory."""
    monkeypatch.setenv(SHM_DIR_ENV, str(tmp_path))
    spec = SPECS[0]
    rank0, path = create_shared_pool(dataclasses.replace(spec, num_kv_heads=2), NUM_BLOCKS, "decode-t")
    (part_path,) = create_part_files([dataclasses.replace(spec, num_kv_heads=1)], NUM_BLOCKS, "decode-t")
    assert part_path.name.startswith("kvserve-decode-t-r1-") and oct(part_path.stat().st_mode)[-3:] == "600"
    dest = pb.KVDestination(backend="shm", worker_id="decode-t", shm_path=str(path), num_blocks=NUM_BLOCKS,
                            kv_heads="2,1", part_shm_paths=[str(part_path)])  # fmt: skip
    origin = Origin(spec, "fp", "prefill-t", TEST_SECURITY)
    transport = ShmTransport.open(dest, origin)
    whole = _whole(spec, 3)
    assert copy_blocks(SplitPool([whole]), [4, 5], transport.pool, [1, 2])
    decode_side = SplitPool([rank0, map_pool_file(dataclasses.replace(spec, num_kv_heads=1), NUM_BLOCKS, part_path)])
    _assert_holds(decode_side, [1, 2], whole, [4, 5])
    transport.close()
    for bad in (pb.KVDestination(kv_heads="2,2", part_shm_paths=[str(part_path)]),
                pb.KVDestination(kv_heads="2,1"), pb.KVDestination(kv_heads="3,x", part_shm_paths=["a"])):
        bad.MergeFrom(pb.KVDestination(backend="shm", worker_id="decode-t", shm_path=str(path),
                                       num_blocks=NUM_BLOCKS))  # fmt: skip
        with pytest.raises(ValueError, match="cannot be mapped onto this model's 3 KV heads"):
            ShmTransport.open(bad, origin)


def test_cuda_ipc_refuses_a_destination_whose_handles_do_not_match_its_layout():
    """A decode worker split over GPU ranks sends one exported pool per part (``part_cuda_ipc_handles``); a
    layout that does not map onto the model's heads, or handles of another count, is refused before any
    handle is opened (opening one needs CUDA: tests/cluster/test_tensor_parallel_gpu.py)."""
    origin = Origin(SPECS[0], "fp", "prefill-t", TEST_SECURITY)
    for bad in (pb.KVDestination(kv_heads="2,1", cuda_ipc_handle=b"{}"),
                pb.KVDestination(kv_heads="2,2", cuda_ipc_handle=b"{}", part_cuda_ipc_handles=[b"{}"]),
                pb.KVDestination(kv_heads="", cuda_ipc_handle=b"{}", part_cuda_ipc_handles=[b"{}"])):  # fmt: skip
        bad.MergeFrom(pb.KVDestination(backend="cuda_ipc", worker_id="decode-t", num_blocks=NUM_BLOCKS))
        with pytest.raises(ValueError, match="cannot be mapped onto this model's 3 KV heads"):
            CudaIpcTransport.open(bad, origin)
