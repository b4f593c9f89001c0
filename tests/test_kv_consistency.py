"""The design documents' consistency check: decoding from the KV cache equals full recomputation, step by step."""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata


def _forward(model, kv_layers, tokens, start, block_table, block_size):
    """Run tokens at positions ``start..`` of one sequence whose earlier KV is already in ``kv_layers``."""
    n = len(tokens)
    end = start + n
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(
            [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        ),
        block_tables=torch.tensor([block_table], dtype=torch.int32),
        seq_lens=torch.tensor([end], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        num_decodes=1 if n == 1 else 0,
    )
    hidden = model(torch.tensor(tokens), torch.arange(start, end), kv_layers, meta)
    return model.compute_logits(hidden)  # (n, vocab)


@torch.inference_mode()
def test_cached_decode_equals_full_recompute_and_transformers(llm, hf_model, engine_prompts):
    runner = llm.engine.runner
    model, block_size = runner.model, runner.block_size
    free = list(reversed(range(runner.num_blocks)))  # a deliberately non-contiguous block table
    block_table = [free[i * 7 % len(free)] for i in range(12)]
    kv = runner.kv_cache.layers

    tokens = list(engine_prompts[4])  # 47 tokens: the sequence crosses block boundaries while decoding
    logits = _forward(model, kv, tokens, 0, block_table, block_size)[-1]
    for _ in range(24):
        tokens.append(int(logits.argmax()))
        cached = _forward(model, kv, tokens[-1:], len(tokens) - 1, block_table, block_size)[-1]
        scratch = [b for b in range(runner.num_blocks) if b not in block_table][:12]
        full = _forward(model, kv, tokens, 0, scratch, block_size)[-1]
        reference = hf_model(torch.tensor([tokens])).logits[0, -1]
        torch.testing.assert_close(cached, full, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(cached, reference, atol=2e-4, rtol=1e-4)
        assert int(cached.argmax()) == int(full.argmax()) == int(reference.argmax())
        logits = cached
