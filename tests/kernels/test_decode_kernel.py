"""Triton paged decode attention vs the PyTorch reference (interpreted on CPU, compiled on CUDA)."""

import pytest
import torch
from paged_kv_testing import (  # noqa: F401  (interpreted_triton: an autouse fixture, found by name)
    DEVICE,
    assert_matches,
    interpreted_triton,
    make_paged_kv,
    random_tensor,
    triton_ops,
)

import kvkernels
from kvkernels import reference

# INT8 error bound vs the full-precision reference (unit-normal q, K, V; scale 1/sqrt(head_dim)):
#   |out - out_fp| <= max(v_scale) / 2 + FP16_ROUNDING + K_PERTURBATION.
# Rounding moves a cached value by at most half its quantization step, and an
# attention output is a convex combination of V rows, so V-only quantization
# ("int8_v") obeys the first two terms exactly (a length-1 sequence reaches
# them). Quantizing K too ("int8") perturbs each score by ~0.01 here, which
# moves the output by less than the extra K_PERTURBATION allowance.
FP16_ROUNDING = 2e-3
K_PERTURBATION = {"int8_v": 0.0, "int8": 0.01}

# (dtype, group, head_dim, block_size, seq_lens, num_splits): every axis is
# covered once or twice rather than through the full cross product.
CASES = [
    pytest.param(torch.float16, 1, 64, 16, [1, 15, 16, 17], None, id="fp16-g1-d64-bs16-page-edges"),
    pytest.param(torch.float32, 3, 128, 32, [1, 31, 32, 33], 3, id="fp32-g3-d128-bs32-page-edges"),
    pytest.param(torch.float16, 7, 64, 32, [1000, 5], 4, id="fp16-g7-long"),
    pytest.param(torch.float32, 8, 128, 16, [1000, 16], 1, id="fp32-g8-long-single-split"),
    pytest.param(torch.float16, 4, 64, 16, [3, 20], 8, id="fp16-more-splits-than-blocks"),
    pytest.param(torch.float16, 2, 96, 16, [40, 7], 2, id="fp16-head-dim-96-padded"),
    pytest.param(torch.float32, 4, 64, 16, [0, 17], 2, id="fp32-empty-sequence-gives-zeros"),
]


@pytest.mark.parametrize("dtype,group,head_dim,block_size,seq_lens,num_splits", CASES)
def test_decode_matches_reference(dtype, group, head_dim, block_size, seq_lens, num_splits):
    generator = torch.Generator().manual_seed(0)
    kv = make_paged_kv(seq_lens, block_size=block_size, num_kv_heads=2, head_dim=head_dim, dtype=dtype,
                       generator=generator)  # fmt: skip
    q = random_tensor(len(seq_lens), 2 * group, head_dim, dtype=dtype, generator=generator)
    scale = head_dim**-0.5

    out = triton_ops().decode(q, kv.k, kv.v, kv.block_tables, kv.seq_lens, scale, num_splits=num_splits)

    expected = reference.paged_decode_attention(q, kv.k, kv.v, kv.block_tables, kv.seq_lens, scale)
    assert not out.isnan().any()
    assert_matches(out, expected)


@pytest.mark.parametrize(
    "block_size, tile_config", [(32, (16, 4, 1)), (16, (128, 8, 3))], ids=["tile<page", "tile=8pages"]
)
def test_decode_tile_config_override(block_size, tile_config):
    """The bench's sweep configs: a tile shorter than a page, and a tile of many pages."""
    generator = torch.Generator().manual_seed(3)
    kv = make_paged_kv([70, 129], block_size=block_size, num_kv_heads=2, head_dim=64, dtype=torch.float16,
                       generator=generator)  # fmt: skip
    q = random_tensor(2, 6, 64, dtype=torch.float16, generator=generator)
    out = triton_ops().decode(q, kv.k, kv.v, kv.block_tables, kv.seq_lens, 0.125, num_splits=2,
                              tile_config=tile_config)  # fmt: skip
    assert_matches(out, reference.paged_decode_attention(q, kv.k, kv.v, kv.block_tables, kv.seq_lens, 0.125))


def test_decode_reads_engine_pool_views():
    """Caches sliced out of a ``[layers, 2, blocks, ...]`` pool and q sliced out of a fused qkv tensor."""
    generator = torch.Generator().manual_seed(1)
    kv = make_paged_kv([33, 70], block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float16, generator=generator)
    pool = torch.zeros(2, 2, *kv.k.shape, dtype=torch.float16, device=DEVICE)
    pool[1, 0], pool[1, 1] = kv.k, kv.v
    qkv = random_tensor(2, 3 * 8, 64, dtype=torch.float16, generator=generator)
    q = qkv[:, 8:16]  # strided view: 8 query heads out of a 24-head fused projection

    out = triton_ops().decode(q, pool[1, 0], pool[1, 1], kv.block_tables, kv.seq_lens, 0.125, num_splits=3)

    assert_matches(out, reference.paged_decode_attention(q, kv.k, kv.v, kv.block_tables, kv.seq_lens, 0.125))


@pytest.mark.parametrize(
    "kv_cache_dtype,group,head_dim,block_size",
    [("int8_v", 4, 64, 16), ("int8", 4, 64, 16), ("int8_v", 7, 128, 32), ("int8", 3, 128, 32)],
)
def test_decode_int8_cache_within_bound(kv_cache_dtype, group, head_dim, block_size):
    generator = torch.Generator().manual_seed(2)
    kv = make_paged_kv([1, 17, 300], block_size=block_size, num_kv_heads=2, head_dim=head_dim, dtype=torch.float16,
                       kv_cache_dtype=kv_cache_dtype, generator=generator)  # fmt: skip
    q = random_tensor(3, 2 * group, head_dim, dtype=torch.float16, generator=generator)
    args = (kv.block_tables, kv.seq_lens, head_dim**-0.5)

    out = triton_ops().decode(q, kv.k, kv.v, *args, k_scale=kv.k_scale, v_scale=kv.v_scale, num_splits=3)

    same_cache = reference.paged_decode_attention(q, kv.k, kv.v, *args, k_scale=kv.k_scale, v_scale=kv.v_scale)
    assert_matches(out, same_cache)
    full_precision = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, *args)
    bound = kv.v_scale.max() / 2 + FP16_ROUNDING + K_PERTURBATION[kv_cache_dtype]
    assert (out.float() - full_precision.float()).abs().max() <= bound


def test_public_api_runs_triton():
    """``kvkernels.paged_decode_attention`` takes the Triton path here: bit-identical to the kernel."""
    generator = torch.Generator().manual_seed(3)
    kv = make_paged_kv([5, 50], block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float16, generator=generator)
    q = random_tensor(2, 6, 64, dtype=torch.float16, generator=generator)
    args = (q, kv.k, kv.v, kv.block_tables, kv.seq_lens, 0.125)

    ops = triton_ops()

    assert kvkernels.use_triton(q.device)
    assert torch.equal(kvkernels.paged_decode_attention(*args), ops.decode(*args))


@pytest.mark.parametrize(
    "num_seqs,num_kv_heads,max_seq_len,tile_tokens,expected",
    [
        (256, 8, 2048, 64, 1),  # 2048 programs: several waves already
        (64, 8, 2048, 64, 1),  # 512 programs fit in one wave; 1024 would leave a ragged second one
        (64, 2, 2048, 128, 4),
        (8, 8, 2048, 64, 8),
        (1, 8, 8192, 64, 64),  # capped
        (1, 8, 100, 64, 2),  # never more splits than tiles
    ],
)
def test_num_splits_fill_the_gpu(num_seqs, num_kv_heads, max_seq_len, tile_tokens, expected):
    assert triton_ops().choose_num_splits(num_seqs, num_kv_heads, max_seq_len, tile_tokens, num_sms=132) == expected


@pytest.mark.gpu
@pytest.mark.gpu
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(32, 8, 128), (14, 2, 64)])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8_v", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_large_on_gpu(num_q_heads, num_kv_heads, head_dim, kv_cache_dtype, dtype):
    generator = torch.Generator().manual_seed(4)
    seq_lens = [1, 15, 16, 17, 4096] + torch.randint(1, 4097, (27,), generator=generator).tolist()
    kv = make_paged_kv(seq_lens, block_size=16, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                       kv_cache_dtype=kv_cache_dtype, generator=generator)  # fmt: skip
    q = random_tensor(len(seq_lens), num_q_heads, head_dim, dtype=dtype, generator=generator)
    args = (q, kv.k, kv.v, kv.block_tables, kv.seq_lens, head_dim**-0.5)

    assert kvkernels.use_triton(q.device)
    out = kvkernels.paged_decode_attention(*args, k_scale=kv.k_scale, v_scale=kv.v_scale)

    assert_matches(out, reference.paged_decode_attention(*args, k_scale=kv.k_scale, v_scale=kv.v_scale))
