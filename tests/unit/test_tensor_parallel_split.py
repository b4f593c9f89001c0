"""How tensor parallelism cuts a model (``engine.models.tensor_parallel``): even splits with the larger parts
first, KV heads whole with their query heads, fused checkpoint tensors cut part by part, a row-parallel bias
on rank 0 alone; read back against the whole tensor by index, not by the same slicing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.model_config import ModelConfig
from engine.models.tensor_parallel import Shard, split

CONFIG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=11, hidden_size=4, intermediate_size=5,
                     num_layers=1, num_heads=6, num_kv_heads=3, head_dim=2, rms_norm_eps=1e-6, rope_theta=1e4,
                     rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=False,
                     attention_bias=True, mlp_bias=True, eos_token_ids=(), bos_token_id=None)  # fmt: skip


def test_split_covers_every_index_once_larger_parts_first():
    for n in range(0, 12):
        for parts in range(1, 5):
            ranges = [split(n, parts, i) for i in range(parts)]
            assert [i for lo, hi in ranges for i in range(lo, hi)] == list(range(n))
            sizes = [hi - lo for lo, hi in ranges]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_each_rank_gets_its_kv_heads_query_groups_and_slices():
    shards = [Shard.of(CONFIG, r, 2) for r in range(2)]
    assert [s.kv_heads for s in shards] == [(0, 2), (2, 3)] and [s.heads for s in shards] == [(0, 4), (4, 6)]
    assert [s.intermediate for s in shards] == [(0, 3), (3, 5)] and [s.vocab for s in shards] == [(0, 6), (6, 11)]
    assert shards[1].config() == dataclasses.replace(CONFIG, num_heads=2, num_kv_heads=1, intermediate_size=2,
                                                     vocab_size=5)  # fmt: skip
    with pytest.raises(ValueError, match="tensor_parallel_size 4 is more than this model's 3 KV heads"):
        Shard.of(CONFIG, 0, 4)


def test_fused_tensors_are_cut_part_by_part_and_row_parallel_biases_stay_on_rank_0():
    rank1 = Shard.of(CONFIG, 1, 2)  # query heads 4, 5 (rows 8..11), KV head 2 (rows 4, 5 of k and of v)
    q, kv = CONFIG.num_heads * CONFIG.head_dim, CONFIG.num_kv_heads * CONFIG.head_dim
    qkv = torch.arange(q + 2 * kv, dtype=torch.float32)[:, None].expand(-1, 4)  # row i holds i
    rows = rank1.cut("model.layers.0.self_attn.qkv_proj.weight", qkv)[:, 0].tolist()
    assert rows == [8, 9, 10, 11, q + 4, q + 5, q + kv + 4, q + kv + 5]
    assert rank1.cut("model.layers.0.self_attn.k_proj.bias", torch.arange(kv)).tolist() == [4, 5]
    o = torch.arange(q)[None, :].expand(4, -1)
    assert rank1.cut("model.layers.0.self_attn.o_proj.weight", o)[0].tolist() == [8, 9, 10, 11]
    gate_up = torch.arange(10)[:, None].expand(-1, 4)  # gate rows 0..4, up rows 5..9; rank 1 holds I 3..4
    assert rank1.cut("model.layers.0.mlp.gate_up_proj.weight", gate_up)[:, 0].tolist() == [3, 4, 8, 9]
    moe = Shard.of(dataclasses.replace(CONFIG, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=5), 1, 2)
    experts = torch.arange(10)[None, :, None].expand(2, -1, 4)  # (experts, 2 I, hidden), stacked
    assert moe.cut("model.layers.0.mlp.experts.gate_up_proj", experts)[1, :, 0].tolist() == [3, 4, 8, 9]
    assert moe.cut("model.layers.0.mlp.experts.1.up_proj.weight", torch.arange(5)[:, None])[:, 0].tolist() == [3, 4]
    assert moe.cut("model.layers.0.mlp.experts.down_proj", torch.arange(5).expand(2, 4, 5))[1, 0].tolist() == [3, 4]
    assert rank1.cut("model.layers.0.mlp.down_proj.weight", torch.arange(5)[None, :])[0].tolist() == [3, 4]
    assert not rank1.cut("model.layers.0.mlp.down_proj.bias", torch.ones(4)).any()
    assert Shard.of(CONFIG, 0, 2).cut("model.layers.0.mlp.down_proj.bias", torch.ones(4)).all()
    assert rank1.cut("lm_head.weight", torch.arange(11)[:, None])[:, 0].tolist() == [6, 7, 8, 9, 10]
    norm = torch.ones(4)
    assert rank1.cut("model.layers.0.input_layernorm.weight", norm) is norm
    assert rank1.cut("model.layers.0.mlp.gate.weight", norm) is norm  # a MoE router: whole on every rank
