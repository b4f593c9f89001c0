"""What engine tests share: the test sizes, greedy sampling, running the model by hand over KV in the pool, and
comparing KV that two schedules computed."""

from __future__ import annotations

import torch

from engine.models.attention import AttentionMetadata
from kvstore import KVCache, token_slots

NUM_NEW_TOKENS = 32
BLOCK_SIZE = 16

# KV that two schedules compute (a prefix read in place or computed inside another prompt, other chunk sizes, a
# neighbour in the batch) differs by summation order only, and which BLAS and attention kernels run depends on
# the CPU and the shapes. Measured on fp32 KV of the 30-layer bundled model over those schedules and over ISAs
# (ATen AVX-512, AVX2 and none; MKL's default and CNR paths): at most 7e-6 of a layer's largest |K| (or |V|),
# the error growing through the layers. 1e-4 leaves a margin of 14; a wrong token, position or block is off by
# the values' own size.
KV_TOLERANCE = 1e-4


def kv_values(cache: KVCache, block_ids: list[int]) -> torch.Tensor:
    """A copy of the blocks' K and V in every layer: ``(layers, 2, blocks, block_size, kv_heads, head_dim)``."""
    return torch.stack([torch.stack([layer.k_cache[block_ids], layer.v_cache[block_ids]]) for layer in cache.layers])


def assert_kv_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """``got`` within ``KV_TOLERANCE`` of ``want``, relative to each layer's largest |K| (or |V|) in ``want``
    (``kv_values`` of float KV)."""
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = want.abs().amax(dim=(2, 3, 4, 5), keepdim=True)  # per layer, K and V apart
    error = ((got - want).abs() / scale).amax(dim=(2, 3, 4, 5))  # (layers, 2)
    layer, k_or_v = divmod(int(error.argmax()), 2)
    assert bool((error <= KV_TOLERANCE).all()), (f"KV off by {float(error.max()):.1e} of its scale in layer {layer}'s "
                                                 f"{'KV'[k_or_v]} (tolerance {KV_TOLERANCE:g})")  # fmt: skip


def greedy(max_tokens: int = NUM_NEW_TOKENS, **kw):
    from engine import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def token_meta(runner, start: int, end: int, block_table: list[int]) -> AttentionMetadata:
    """The metadata of one sequence's tokens at positions ``start..end`` over ``block_table`` in ``runner``'s pool:
    one token is a decode, more a prefill."""
    device = runner.device
    return AttentionMetadata(
        slot_mapping=torch.tensor(token_slots(block_table, start, end, runner.block_size), device=device),
        block_tables=torch.tensor([block_table], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([end], dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor([0, end - start], dtype=torch.int32, device=device),
        num_decodes=1 if end - start == 1 else 0,
    )


def forward_tokens(runner, tokens: list[int], start: int, block_table: list[int]) -> torch.Tensor:
    """Logits ``(len(tokens), vocab)`` of ``tokens`` at positions ``start..``; earlier positions' KV must be
    in ``runner``'s pool at ``block_table``. One token takes the decode kernel, more take the prefill kernel."""
    end, device = start + len(tokens), runner.device
    meta = token_meta(runner, start, end, block_table)
    ids = torch.tensor(tokens, device=device)
    hidden = runner.model(ids, torch.arange(start, end, device=device), runner.kv_cache.layers, meta)
    return runner.model.compute_logits(hidden)
