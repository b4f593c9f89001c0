"""A pool's blocks as bytes, and their checksum: what the ``grpc`` transport sends, and what both ends of
every hand-off compare. A pool split over tensor-parallel ranks (``kvstore.split_pool``) gives the bytes its
unsplit twin would: each token's row of all heads, whole.

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
from kvstore.split_pool import SplitPool

CHUNK_BLOCKS = 16  # blocks per gRPC KV chunk (about 12 MB for the bundled model in float32)


def _regions(pool: KVCache | SplitPool) -> list[list[torch.Tensor]]:
    """Every layer's K, V (and scale) region as its parts' ``(num_blocks, block_size, row bytes)`` uint8 views
    (``SplitPool.regions``): one part for an unsplit pool."""
    return SplitPool.of(pool).regions()


def block_nbytes(pool: KVCache | SplitPool) -> int:
    """Bytes of one block across every layer, region and head."""
    return sum(part.shape[1] * part.shape[2] for region in _regions(pool) for part in region)


def _region_parts(pool: KVCache | SplitPool, flat, n: int) -> Iterator[tuple[list[torch.Tensor], object]]:
    """``(region parts, bytes)`` pairs: ``flat``, the region-major bytes of ``n`` blocks, cut at each region's
    share and shaped ``(n, block_size, row bytes)``, whose columns the parts hold in order."""
    offset = 0
    for parts in _regions(pool):
        block_size, row = parts[0].shape[1], sum(p.shape[2] for p in parts)
        size = n * block_size * row
        yield parts, flat[offset : offset + size].reshape(n, block_size, row)
        offset += size


def _columns(parts: list[torch.Tensor]) -> Iterator[tuple[torch.Tensor, slice]]:
    """Each part beside the columns of a token's row (all heads) it holds."""
    at = 0
    for part in parts:
        yield part, slice(at, at + part.shape[2])
        at += part.shape[2]


def read_blocks(pool: KVCache | SplitPool, block_ids: list[int]) -> bytes:
    """The blocks' bytes, region-major, every token's row of all heads whole (the bytes of an unsplit pool).

    Region-major keeps every region's part one contiguous run, so an unsplit pool reads with one
    ``index_select`` per region straight into the byte buffer.
    """
    pool = SplitPool.of(pool)
    index = torch.tensor(block_ids, dtype=torch.long, device=pool.device)
    out = torch.empty(len(block_ids) * block_nbytes(pool), dtype=torch.uint8, device=pool.device)
    for parts, rows in _region_parts(pool, out, len(block_ids)):
        if len(parts) == 1:
            torch.index_select(parts[0], 0, index, out=rows)
            continue
        for part, columns in _columns(parts):  # (a GPU rank's part is on its own device)
            rows[:, :, columns] = part.index_select(0, index.to(part.device))
    return out.cpu().numpy().tobytes()


def write_blocks(pool: KVCache | SplitPool, block_ids: list[int], data: bytes) -> None:
    """Inverse of ``read_blocks``: write ``data`` into ``block_ids`` of this pool (each part its heads);
    ``ValueError`` when a block id is outside the pool or ``data`` is not exactly their size.

    Runs on gRPC threads, so on the CPU it copies with NumPy, not with PyTorch ops
    that would start another OpenMP pool (see ``rpc.loop.Loop``).
    """
    pool = SplitPool.of(pool)
    n = len(block_ids)
    bad = [b for b in block_ids if not 0 <= b < pool.num_blocks]
    if bad:
        raise ValueError(f"block ids {bad[:4]} are outside this pool of {pool.num_blocks} blocks")
    if len(data) != n * block_nbytes(pool):
        raise ValueError(f"KV chunk holds {len(data)} bytes, {n} blocks need {n * block_nbytes(pool)}")
    if pool.device.type == "cpu":
        index = np.asarray(block_ids, dtype=np.int64)
        for parts, rows in _region_parts(pool, np.frombuffer(data, dtype=np.uint8), n):
            for part, columns in _columns(parts):
                part.numpy()[index] = rows[:, :, columns]
        return
    with warnings.catch_warnings():  # read-only source: torch warns that it cannot write to ``bytes``
        warnings.simplefilter("ignore", UserWarning)
        source = torch.frombuffer(data, dtype=torch.uint8).to(pool.device)
    index = torch.tensor(block_ids, dtype=torch.long, device=pool.device)
    for parts, rows in _region_parts(pool, source, n):
        for part, columns in _columns(parts):  # (a GPU rank's part is on its own device)
            part.index_copy_(0, index.to(part.device), rows[:, :, columns].to(part.device))
    pool.synchronize()


def checksum(data: bytes) -> str:
    """xxh3-128 of ``data``: fast enough (~10 GB/s) to verify every hand-off."""
    return xxhash.xxh3_128_hexdigest(data)


def chunked(block_ids: list[int]) -> list[list[int]]:
    """How a hand-off splits its blocks into chunks of ``CHUNK_BLOCKS``."""
    return [block_ids[i : i + CHUNK_BLOCKS] for i in range(0, len(block_ids), CHUNK_BLOCKS)]


def checksum_blocks(pool: KVCache | SplitPool, block_ids: list[int]) -> str:
    """The checksum of a hand-off of ``block_ids``: of ``read_blocks`` of each chunk, in order ('' for none),
    so the same for every split of the pool over ranks: it covers every part.

    On the CPU it hashes an unsplit pool in place, without copying the blocks out, a run of consecutive
    blocks at a time (the hash of the bytes is the same however they are fed to it).
    """
    pool = SplitPool.of(pool)
    hasher = xxhash.xxh3_128()
    for chunk in chunked(block_ids):
        if pool.device.type != "cpu" or pool.split:
            hasher.update(read_blocks(pool, chunk))
            continue
        runs = _runs(chunk)
        for (region,) in _regions(pool):
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
