"""``kvkernels.reference.paged_decode_attention`` (the CPU path, and what the Triton kernel is checked against)
against attention written out per sequence in float64: lengths from different length classes, empty rows,
table entries past a sequence's blocks that hold garbage, and groups split to bound one gather."""

from __future__ import annotations

import pytest
import torch

from kvkernels import reference
from kvkernels.reference import attention
from kvkernels.reference.attention import _length_groups


def _naive(q, k_cache, v_cache, block_tables, seq_lens, scale):
    num_seqs, num_q_heads, _ = q.shape
    group = num_q_heads // k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, length in enumerate(seq_lens.tolist()):
        if length == 0:
            continue
        blocks = block_tables[i, : -(-length // k_cache.shape[1])].long()
        k = k_cache[blocks].flatten(0, 1)[:length].double()  # (len, kv_heads, dim)
        v = v_cache[blocks].flatten(0, 1)[:length].double()
        for h in range(num_q_heads):
            weights = torch.softmax(k[:, h // group] @ q[i, h].double() * scale, dim=0)
            out[i, h] = weights @ v[:, h // group]
    return out


@pytest.mark.parametrize("max_gather", [1 << 24, 256])  # 256 elements: every group split to single rows
def test_reference_decode_matches_attention_written_out(monkeypatch, max_gather):
    monkeypatch.setattr(attention, "_MAX_GATHER_ELEMENTS", max_gather)
    torch.manual_seed(0)
    block_size, num_kv_heads, head_dim, num_q_heads = 4, 2, 8, 6
    seq_lens = torch.tensor([5, 0, 1, 17, 40, 3, 0, 33, 8, 64], dtype=torch.int32)
    width = 20  # wider than any sequence needs: the entries past its blocks are out-of-range garbage
    k_cache = torch.randn(80, block_size, num_kv_heads, head_dim)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.full((len(seq_lens), width), 10_000, dtype=torch.int32)
    free = torch.randperm(80).tolist()
    for i, length in enumerate(seq_lens.tolist()):
        needed = -(-length // block_size)
        block_tables[i, :needed] = torch.tensor([free.pop() for _ in range(needed)], dtype=torch.int32)
    q = torch.randn(len(seq_lens), num_q_heads, head_dim)
    out = reference.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.3)
    torch.testing.assert_close(out.double(), _naive(q, k_cache, v_cache, block_tables, seq_lens, 0.3),
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    assert out[1].abs().sum() == 0 and out[6].abs().sum() == 0


def test_reference_decode_equal_lengths_is_one_group():
    lens = torch.full((256,), 48)
    assert _length_groups(lens, 32) == [None]
    assert [g.tolist() for g in _length_groups(torch.tensor([0, 3, 4, 5, 9]), 32)] == [[1, 2], [3], [4]]
