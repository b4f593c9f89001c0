"""Triton paged decode attention vs the PyTorch reference (interpreted on CPU, compiled on CUDA)."""

import pytest
import torch

import kernels
from kernels import reference
from kernels.decode_attention import choose_num_splits

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# INT8 error bounds vs the full-precision reference, for unit-normal q, K, V
# (head_dim 64, scale 1/8). Rounding moves each cached value by at most half a
# quantization step, absmax/254 ~ 0.015 here; an attention output is a convex
# combination of V rows, so V-only quantization stays below that, and K
# quantization perturbs each score by ~0.01, which adds about as much again.
INT8_MAX_ABS_ERROR = {"int8_v": 0.015, "int8": 0.03}

# (dtype, group, head_dim, block_size, seq_lens, num_splits): every axis is
# covered once or twice rather than through the full cross product.
CASES = [
    pytest.param(torch.float16, 1, 64, 16, [1, 15, 16, 17], None, id="fp16-g1-d64-bs16-page-edges"),
    pytest.param(torch.float32, 3, 128, 32, [1, 31, 32, 33], 3, id="fp32-g3-d128-bs32-page-edges"),
    pytest.param(torch.float16, 7, 64, 32, [1000, 5], 4, id="fp16-g7-long"),
    pytest.param(torch.float32, 8, 128, 16, [1000, 16], 1, id="fp32-g8-long-single-split"),
    pytest.param(torch.float16, 4, 64, 16, [3, 20], 8, id="fp16-more-splits-than-blocks"),
    pytest.param(torch.float16, 2, 96, 16, [40, 7], 2, id="fp16-head-dim-96-padded"),
    pytest.param(torch.float32, 4, 64, 16, [0, 17], 2, id="fp32-empty-sequence"),
]


def _query(num_seqs, num_q_heads, head_dim, dtype, device, generator):
    return torch.randn(num_seqs, num_q_heads, head_dim, generator=generator).to(dtype).to(device)


@pytest.mark.parametrize("dtype,group,head_dim,block_size,seq_lens,num_splits", CASES)
def test_decode_matches_reference(
    triton_ops, make_paged_kv, assert_matches, device, dtype, group, head_dim, block_size, seq_lens, num_splits
):
    generator = torch.Generator().manual_seed(0)
    num_kv_heads = 2
    kv = make_paged_kv(
        seq_lens, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, generator=generator
    )
    q = _query(len(seq_lens), num_kv_heads * group, head_dim, dtype, device, generator)
    scale = head_dim**-0.5

    out = triton_ops.decode(q, kv.k, kv.v, kv.block_tables, kv.seq_lens, scale, num_splits=num_splits)

    expected = reference.paged_decode_attention(q, kv.k, kv.v, kv.block_tables, kv.seq_lens, scale)
    assert not out.isnan().any()
    assert_matches(out, expected)


def test_decode_reads_engine_pool_views(triton_ops, make_paged_kv, assert_matches, device):
    """Caches sliced out of a ``[layers, 2, blocks, ...]`` pool and q sliced out of a fused qkv tensor."""
    generator = torch.Generator().manual_seed(1)
    kv = make_paged_kv([33, 70], block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float16, generator=generator)
    pool = torch.zeros(2, 2, *kv.k.shape, dtype=torch.float16, device=device)
    pool[1, 0], pool[1, 1] = kv.k, kv.v
    qkv = _query(2, 3 * 8, 64, torch.float16, device, generator)
    q = qkv[:, 8:16]  # strided view: 8 query heads of a 24-head fused projection

    out = triton_ops.decode(q, pool[1, 0], pool[1, 1], kv.block_tables, kv.seq_lens, 0.125, num_splits=3)

    assert_matches(out, reference.paged_decode_attention(q, kv.k, kv.v, kv.block_tables, kv.seq_lens, 0.125))


@pytest.mark.parametrize("kv_cache_dtype", ["int8_v", "int8"])
def test_decode_int8_cache(triton_ops, make_paged_kv, assert_matches, device, kv_cache_dtype):
    generator = torch.Generator().manual_seed(2)
    kv = make_paged_kv(
        [1, 17, 300],
        block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float16,
        kv_cache_dtype=kv_cache_dtype, generator=generator,
    )  # fmt: skip
    q = _query(3, 8, 64, torch.float16, device, generator)
    args = (kv.block_tables, kv.seq_lens, 0.125)

    out = triton_ops.decode(q, kv.k, kv.v, *args, k_scale=kv.k_scale, v_scale=kv.v_scale, num_splits=3)

    same_cache = reference.paged_decode_attention(q, kv.k, kv.v, *args, k_scale=kv.k_scale, v_scale=kv.v_scale)
    assert_matches(out, same_cache)
    full_precision = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, *args)
    assert (out.float() - full_precision.float()).abs().max() <= INT8_MAX_ABS_ERROR[kv_cache_dtype]


def test_public_api_runs_triton(triton_ops, make_paged_kv, device):
    """``kernels.paged_decode_attention`` takes the Triton path here and gives the kernel's exact output."""
    generator = torch.Generator().manual_seed(3)
    kv = make_paged_kv([5, 50], block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float16, generator=generator)
    q = _query(2, 6, 64, torch.float16, device, generator)
    args = (q, kv.k, kv.v, kv.block_tables, kv.seq_lens, 0.125)

    assert kernels.use_triton(q.device)
    assert torch.equal(kernels.paged_decode_attention(*args), triton_ops.decode(*args))


@pytest.mark.parametrize(
    "num_seqs,num_kv_heads,max_seq_len,tile_tokens,expected",
    [
        (64, 8, 2048, 64, 1),  # 512 programs already fill 132 SMs
        (8, 8, 2048, 64, 5),  # 64 programs -> 5 splits of ~410 tokens
        (1, 8, 8192, 64, 33),
        (1, 2, 8192, 128, 64),  # capped at _MAX_SPLITS
        (1, 8, 100, 64, 2),  # never more splits than tiles
    ],
)
def test_num_splits_fill_an_h100_class_gpu(num_seqs, num_kv_heads, max_seq_len, tile_tokens, expected):
    assert choose_num_splits(num_seqs, num_kv_heads, max_seq_len, tile_tokens, num_sms=132) == expected


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(32, 8, 128), (14, 2, 64)])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8_v", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_large_on_gpu(make_paged_kv, assert_matches, num_q_heads, num_kv_heads, head_dim, kv_cache_dtype, dtype):
    generator = torch.Generator().manual_seed(4)
    seq_lens = [1, 15, 16, 17, 4096] + torch.randint(1, 4097, (27,), generator=generator).tolist()
    kv = make_paged_kv(
        seq_lens, block_size=16, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
        kv_cache_dtype=kv_cache_dtype, generator=generator,
    )  # fmt: skip
    q = _query(len(seq_lens), num_q_heads, head_dim, dtype, "cuda", generator)
    args = (q, kv.k, kv.v, kv.block_tables, kv.seq_lens, head_dim**-0.5)

    assert kernels.use_triton(q.device)
    out = kernels.paged_decode_attention(*args, k_scale=kv.k_scale, v_scale=kv.v_scale)

    assert_matches(out, reference.paged_decode_attention(*args, k_scale=kv.k_scale, v_scale=kv.v_scale))
