"""A tiny random Qwen2 checkpoint written by transformers: milliseconds per step on a CPU."""

from __future__ import annotations

import torch

TINY_SHAPE = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True)  # fmt: skip


def write_tiny_model(out_dir) -> str:
    """A 2-layer Qwen2 of width 64 and 1,024 tokens, random weights (fp32): milliseconds per step on a CPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **TINY_SHAPE), dtype=torch.float32)
    model.save_pretrained(out_dir)
    return str(out_dir)
