"""Triton Gumbel-max draw: one token per row of scaled logits, the counter-based noise made in registers.

Program ``(row, tile)`` reads ``BLOCK`` logits of one row once, hashes each
token id into the same splitmix64 uniform as ``reference.uniform_noise``, scores
``logit - log(-log(u))`` and writes the tile's best (score, token); one program
per row then picks the best tile. Splitting the vocabulary over tiles keeps the
GPU busy when only a few rows sample (a 152k vocabulary is 38 tiles a row).
Ties go to the lowest token id, as with ``torch.argmax``; ``-inf`` logits stay
``-inf`` (the noise is finite), so filtered tokens are never drawn.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096  # tokens per program: 16 per thread at 8 warps

# splitmix64's constants; Triton types integer literals in [2**63, 2**64) as uint64
_GOLDEN: tl.constexpr = tl.constexpr(0x9E3779B97F4A7C15)
_MIX1: tl.constexpr = tl.constexpr(0xBF58476D1CE4E5B9)
_MIX2: tl.constexpr = tl.constexpr(0x94D049BB133111EB)


@triton.jit
def _mix64(x):
    """splitmix64's finalizer on uint64 (multiplies wrap, ``>>`` is a logical shift on unsigned values)."""
    x = x ^ (x >> 30)
    x = x * _MIX1
    x = x ^ (x >> 27)
    x = x * _MIX2
    return x ^ (x >> 31)


@triton.jit
def _gumbel_tile_kernel(
    logits_ptr,  # [rows, vocab_size] float32, contiguous last dim
    seeds_ptr,  # [rows] int64
    positions_ptr,  # [rows] int64
    tile_scores_ptr,  # [rows, num_tiles] float32
    tile_tokens_ptr,  # [rows, num_tiles] int32
    stride_row,
    vocab_size,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    # int64 bits reinterpreted as uint64: the reference's wrapping int64 arithmetic has exactly these bits
    seed = tl.load(seeds_ptr + row).to(tl.uint64, bitcast=True)
    position = tl.load(positions_ptr + row).to(tl.uint64, bitcast=True)
    key = _mix64(_mix64(seed) + position)
    tokens = tile * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab_size
    logits = tl.load(logits_ptr + row * stride_row + tokens, mask=in_vocab, other=float("-inf"))
    bits = _mix64(key + (tokens + 1).to(tl.uint64) * _GOLDEN)
    # the top 23 bits: (k + 0.5) / 2**23 is exact in float32 and never 0 or 1, so both logs stay finite
    uniforms = ((bits >> 41).to(tl.float32) + 0.5) * 1.1920928955078125e-07
    scores = logits - tl.log(-tl.log(uniforms))
    best, index = tl.max(scores, 0, return_indices=True, return_indices_tie_break_left=True)
    out = row * tl.num_programs(1) + tile
    tl.store(tile_scores_ptr + out, best)
    tl.store(tile_tokens_ptr + out, tile * BLOCK + index)


@triton.jit
def _best_tile_kernel(
    tile_scores_ptr,  # [rows, num_tiles] float32
    tile_tokens_ptr,  # [rows, num_tiles] int32
    tokens_ptr,  # [rows] int64
    num_tiles,
    TILES_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    tiles = tl.arange(0, TILES_BLOCK)
    scores = tl.load(tile_scores_ptr + row * num_tiles + tiles, mask=tiles < num_tiles, other=float("-inf"))
    # the lowest tile wins a tie, and within a tile the lowest token did: the lowest token id overall
    best = tl.argmax(scores, 0, tie_break_left=True)
    token = tl.load(tile_tokens_ptr + row * num_tiles + best)
    tl.store(tokens_ptr + row, token.to(tl.int64))


def gumbel_argmax(scaled_logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Triton twin of ``reference.gumbel_argmax``: ``scaled_logits (rows, vocab)`` float32, ``seeds (rows,)``,
    ``positions (rows,)`` int64 -> ``(rows,)`` int64 token ids. Two launches, no host sync."""
    rows, vocab_size = scaled_logits.shape
    if scaled_logits.dtype != torch.float32 or scaled_logits.stride(-1) != 1:
        raise ValueError(f"scaled_logits must be float32 with a contiguous last dimension (got "
                         f"{scaled_logits.dtype}, stride {scaled_logits.stride(-1)})")  # fmt: skip
    tokens = torch.empty(rows, dtype=torch.int64, device=scaled_logits.device)
    if rows == 0:
        return tokens
    block = min(_BLOCK, triton.next_power_of_2(vocab_size))
    num_tiles = triton.cdiv(vocab_size, block)
    tile_scores = torch.empty(rows, num_tiles, dtype=torch.float32, device=scaled_logits.device)
    tile_tokens = torch.empty(rows, num_tiles, dtype=torch.int32, device=scaled_logits.device)
    _gumbel_tile_kernel[(rows, num_tiles)](
        scaled_logits, seeds, positions, tile_scores, tile_tokens, scaled_logits.stride(0), vocab_size,
        BLOCK=block, num_warps=8 if block >= 2048 else 4,
    )  # fmt: skip
    _best_tile_kernel[(rows,)](
        tile_scores, tile_tokens, tokens, num_tiles, TILES_BLOCK=triton.next_power_of_2(num_tiles), num_warps=1,
    )  # fmt: skip
    return tokens
