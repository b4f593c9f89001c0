"""The design documents' consistency check: decoding from the KV cache equals full recomputation, step by step."""

from __future__ import annotations

import torch
from engine_testing import forward_tokens


@torch.inference_mode()
def test_cached_decode_equals_full_recompute_and_transformers(llm, hf_model, engine_prompts):
    runner, blocks = llm.engine.runner, llm.engine.block_manager
    # Own the blocks written here (the shared engine's prefix cache must not see them overwritten).
    assert blocks.allocate("kv-consistency", 30 * blocks.block_size)
    owned = blocks.block_table("kv-consistency")
    try:
        block_table = [owned[i * 7 % len(owned)] for i in range(12)]  # deliberately non-contiguous
        scratch = [b for b in owned if b not in block_table][:12]
        tokens = list(engine_prompts[4])  # 47 tokens: the sequence crosses block boundaries while decoding
        logits = forward_tokens(runner, tokens, 0, block_table)[-1]
        for _ in range(8):  # to 55 tokens: across the block boundary at 48
            tokens.append(int(logits.argmax()))
            cached = forward_tokens(runner, tokens[-1:], len(tokens) - 1, block_table)[-1]
            full = forward_tokens(runner, tokens, 0, scratch)[-1]
            reference = hf_model(torch.tensor([tokens])).logits[0, -1]
            torch.testing.assert_close(cached, full, atol=2e-4, rtol=1e-4)
            torch.testing.assert_close(cached, reference, atol=2e-4, rtol=1e-4)
            assert int(cached.argmax()) == int(full.argmax()) == int(reference.argmax())
            logits = cached
    finally:
        blocks.free("kv-consistency")
