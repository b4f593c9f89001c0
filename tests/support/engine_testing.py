"""What engine tests share: the test sizes, greedy sampling, and running the model by hand over KV in the pool."""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata
from kvstore import token_slots

NUM_NEW_TOKENS = 32
BLOCK_SIZE = 16


def greedy(max_tokens: int = NUM_NEW_TOKENS, **kw):
    from engine import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def forward_tokens(runner, tokens: list[int], start: int, block_table: list[int]) -> torch.Tensor:
    """Logits ``(len(tokens), vocab)`` of ``tokens`` at positions ``start..``; earlier positions' KV must be
    in ``runner``'s pool at ``block_table``. One token takes the decode kernel, more take the prefill kernel."""
    n, end, device = len(tokens), start + len(tokens), runner.device
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(token_slots(block_table, start, end, runner.block_size), device=device),
        block_tables=torch.tensor([block_table], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([end], dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=device),
        num_decodes=1 if n == 1 else 0,
    )
    ids = torch.tensor(tokens, device=device)
    hidden = runner.model(ids, torch.arange(start, end, device=device), runner.kv_cache.layers, meta)
    return runner.model.compute_logits(hidden)
