"""The KV layout's fingerprint: equal only for pools whose bytes are interchangeable."""

from __future__ import annotations

import dataclasses

import torch

from kvstore import KVCacheSpec
from kvstore.layout import fingerprint

SPEC = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)


def test_fingerprint_depends_on_layout():
    assert fingerprint("LlamaForCausalLM", SPEC) == fingerprint("LlamaForCausalLM", dataclasses.replace(SPEC))
    assert fingerprint("LlamaForCausalLM", SPEC) != fingerprint(
        "LlamaForCausalLM", dataclasses.replace(SPEC, block_size=32)
    )
    assert fingerprint("LlamaForCausalLM", SPEC) != fingerprint("Qwen2ForCausalLM", SPEC)
    assert fingerprint("LlamaForCausalLM", SPEC) != fingerprint(
        "LlamaForCausalLM", dataclasses.replace(SPEC, kv_cache_dtype="int8_v")
    )
