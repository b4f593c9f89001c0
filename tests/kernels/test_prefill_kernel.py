"""Triton paged prefill attention vs the PyTorch reference (interpreted on CPU, compiled on CUDA)."""

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

# See test_decode_kernel.py for how the INT8 bound is derived.
FP16_ROUNDING = 2e-3
K_PERTURBATION = {"int8_v": 0.0, "int8": 0.01}

# (dtype, group, head_dim, block_size, [(cached tokens, new tokens) per sequence])
CASES = [
    pytest.param(torch.float16, 1, 64, 16, [(0, 5), (16, 1), (33, 20), (10, 0)], id="fp16-g1-d64-bs16"),
    pytest.param(torch.float32, 3, 128, 32, [(31, 2), (0, 40), (32, 1)], id="fp32-g3-d128-bs32"),
    pytest.param(torch.float16, 7, 64, 32, [(64, 17), (1, 1)], id="fp16-g7"),
    pytest.param(torch.float32, 8, 64, 16, [(0, 1), (1000, 3)], id="fp32-g8-long-prefix"),
    pytest.param(torch.float16, 2, 96, 16, [(17, 9)], id="fp16-head-dim-96-padded"),
]


def _packed_batch(chunks, *, group, head_dim, block_size, dtype, generator, kv_cache_dtype="auto", num_kv_heads=2):
    """Paged prefixes plus packed new tokens; q/k/v are views into one fused projection, as a model makes them."""
    cached = [c for c, _ in chunks]
    kv = make_paged_kv(cached, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                       kv_cache_dtype=kv_cache_dtype, generator=generator)  # fmt: skip
    num_tokens = sum(n for _, n in chunks)
    num_q_heads = num_kv_heads * group
    qkv = random_tensor(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim, dtype=dtype, generator=generator)
    q, k, v = qkv.split([num_q_heads, num_kv_heads, num_kv_heads], dim=1)
    cu_seqlens_q = torch.tensor([0] + [n for _, n in chunks], dtype=torch.int32).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([c + n for c, n in chunks], dtype=torch.int32)
    return kv, q, k, v, cu_seqlens_q.to(DEVICE), seq_lens.to(DEVICE)


@pytest.mark.parametrize("dtype,group,head_dim,block_size,chunks", CASES)
def test_prefill_matches_reference(dtype, group, head_dim, block_size, chunks):
    generator = torch.Generator().manual_seed(0)
    kv, q, k, v, cu_seqlens_q, seq_lens = _packed_batch(
        chunks, group=group, head_dim=head_dim, block_size=block_size, dtype=dtype, generator=generator
    )
    args = (q, k, v, kv.k, kv.v, kv.block_tables, cu_seqlens_q, seq_lens, head_dim**-0.5)

    out = triton_ops().prefill(*args)

    assert not out.isnan().any()
    assert_matches(out, reference.paged_prefill_attention(*args))


@pytest.mark.parametrize("kv_cache_dtype", ["int8_v", "int8"])
def test_prefill_int8_prefix_within_bound(kv_cache_dtype):
    generator = torch.Generator().manual_seed(1)
    kv, q, k, v, cu_seqlens_q, seq_lens = _packed_batch(
        [(40, 7), (0, 5), (1, 2)], group=4, head_dim=64, block_size=16, dtype=torch.float16,
        kv_cache_dtype=kv_cache_dtype, generator=generator,
    )  # fmt: skip
    rest = (kv.block_tables, cu_seqlens_q, seq_lens, 0.125)

    out = triton_ops().prefill(q, k, v, kv.k, kv.v, *rest, k_scale=kv.k_scale, v_scale=kv.v_scale)

    assert_matches(out, reference.paged_prefill_attention(q, k, v, kv.k, kv.v, *rest, k_scale=kv.k_scale,
                                                          v_scale=kv.v_scale))  # fmt: skip
    full_precision = reference.paged_prefill_attention(q, k, v, kv.k_cache, kv.v_cache, *rest)
    bound = kv.v_scale.max() / 2 + FP16_ROUNDING + K_PERTURBATION[kv_cache_dtype]
    assert (out.float() - full_precision.float()).abs().max() <= bound


@pytest.mark.gpu
@pytest.mark.gpu
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(32, 8, 128), (14, 2, 64)])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8_v", "int8"])
def test_prefill_large_bf16_on_gpu(num_q_heads, num_kv_heads, head_dim, kv_cache_dtype):
    generator = torch.Generator().manual_seed(2)
    chunks = [(0, 1000), (16, 1), (2000, 300), (4095, 512), (17, 64), (0, 1)]
    kv, q, k, v, cu_seqlens_q, seq_lens = _packed_batch(
        chunks, group=num_q_heads // num_kv_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16,
        dtype=torch.bfloat16, kv_cache_dtype=kv_cache_dtype, generator=generator,
    )  # fmt: skip
    args = (q, k, v, kv.k, kv.v, kv.block_tables, cu_seqlens_q, seq_lens, head_dim**-0.5)

    assert kvkernels.use_triton(q.device)
    out = kvkernels.paged_prefill_attention(*args, k_scale=kv.k_scale, v_scale=kv.v_scale)

    assert_matches(out, reference.paged_prefill_attention(*args, k_scale=kv.k_scale, v_scale=kv.v_scale))
