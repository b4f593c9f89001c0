"""A pool's blocks as bytes, and their checksum: what the ``grpc`` transport sends, and what both ends of
every hand-off compare.

The bytes of some blocks are region-major: for each layer's K, V (then its scales, with an int8 KV cache),
those blocks in order. A hand-off of many blocks goes in chunks of ``CHUNK_BLOCKS`` (``chunked``), and its
checksum is xxh3-128 over the chunks' bytes in order (``checksum_blocks``), whichever transport carried it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import numpy as np
import torch
import xxhash

from kvstore.kv_cache import KVCache

CHUNK_BLOCKS = 16  # blocks per gRPC KV chunk (about 12 MB for the bundled model in float32)


def _regions(cache: KVCache) -> list[torch.Tensor]:
    """Every layer's K, V (and scale) regions, each viewed as ``(num_blocks, bytes per block)`` uint8."""
    regions = []
    for layer in cache.layers:
        for t in (layer.k_cache, layer.v_cache, layer.k_scale, layer.v_scale):
            if t is not None:
                regions.append(t.view(t.shape[0], -1).view(torch.uint8))
    return regions


def block_nbytes(cache: KVCache) -> int:
    """Bytes of one block across every layer and region."""
    return sum(r.shape[1] for r in _regions(cache))


def _region_parts(cache: KVCache, flat, n: int) -> Iterator[tuple[torch.Tensor, object]]:
    """``(region, part)`` pairs: ``flat``, the region-major bytes of ``n`` blocks, cut at each region's share."""
    offset = 0
    for region in _regions(cache):
        size = n * region.shape[1]
        yield region, flat[offset : offset + size].reshape(n, -1)
        offset += size


def read_blocks(cache: KVCache, block_ids: list[int]) -> bytes:
    """The blocks' bytes, region-major.

    Region-major keeps every region's part one contiguous run, so reading and writing are one
    ``index_select`` / ``index_copy_`` per region straight between the pool and the byte buffer.
    """
    device = cache.buffer.device
    index = torch.tensor(block_ids, dtype=torch.long, device=device)
    out = torch.empty(len(block_ids) * block_nbytes(cache), dtype=torch.uint8, device=device)
    for region, part in _region_parts(cache, out, len(block_ids)):
        torch.index_select(region, 0, index, out=part)
    return out.cpu().numpy().tobytes()


def write_blocks(cache: KVCache, block_ids: list[int], data: bytes) -> None:
    """Inverse of ``read_blocks``: write ``data`` into ``block_ids`` of this pool; ``ValueError`` when a block
    id is outside the pool or ``data`` is not exactly their size.

    Runs on gRPC threads, so on the CPU it copies with NumPy, not with PyTorch ops
    that would start another OpenMP pool (see ``rpc.loop.Loop``).
    """
    n = len(block_ids)
    bad = [b for b in block_ids if not 0 <= b < cache.num_blocks]
    if bad:
        raise ValueError(f"block ids {bad[:4]} are outside this pool of {cache.num_blocks} blocks")
    if len(data) != n * block_nbytes(cache):
        raise ValueError(f"KV chunk holds {len(data)} bytes, {n} blocks need {n * block_nbytes(cache)}")
    device = cache.buffer.device
    if device.type == "cpu":
        index = np.asarray(block_ids, dtype=np.int64)
        for region, part in _region_parts(cache, np.frombuffer(data, dtype=np.uint8), n):
            region.numpy()[index] = part
        return
    with warnings.catch_warnings():  # read-only source: torch warns that it cannot write to ``bytes``
        warnings.simplefilter("ignore", UserWarning)
        source = torch.frombuffer(data, dtype=torch.uint8).to(device)
    index = torch.tensor(block_ids, dtype=torch.long, device=device)
    for region, part in _region_parts(cache, source, n):
        region.index_copy_(0, index, part)


def checksum(data: bytes) -> str:
    """xxh3-128 of ``data``: fast enough (~10 GB/s) to verify every hand-off."""
    return xxhash.xxh3_128_hexdigest(data)


def chunked(block_ids: list[int]) -> list[list[int]]:
    """How a hand-off splits its blocks into chunks of ``CHUNK_BLOCKS``."""
    return [block_ids[i : i + CHUNK_BLOCKS] for i in range(0, len(block_ids), CHUNK_BLOCKS)]


def checksum_blocks(cache: KVCache, block_ids: list[int]) -> str:
    """The checksum of a hand-off of ``block_ids``: of ``read_blocks`` of each chunk, in order ('' for none).

    On the CPU it hashes the pool in place, without copying the blocks out, a run of consecutive blocks at a
    time (the hash of the bytes is the same however they are fed to it).
    """
    hasher = xxhash.xxh3_128()
    for chunk in chunked(block_ids):
        if cache.buffer.device.type != "cpu":
            hasher.update(read_blocks(cache, chunk))
            continue
        runs = _runs(chunk)
        for region in _regions(cache):
            array = region.numpy()
            for start, stop in runs:
                hasher.update(array[start:stop])
    return hasher.hexdigest() if block_ids else ""


def _runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """``block_ids`` as (start, stop) ranges of consecutive ids, in order."""
    runs: list[tuple[int, int]] = []
    for block in block_ids:
        if runs and runs[-1][1] == block:
            runs[-1] = (runs[-1][0], block + 1)
        else:
            runs.append((block, block + 1))
    return runs
