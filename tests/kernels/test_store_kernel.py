"""Triton KV store vs the PyTorch reference: exact bytes, skipped slots untouched, INT8 quantization."""

import pytest
import torch
from paged_kv_testing import (  # noqa: F401  (interpreted_triton: an autouse fixture, found by name)
    DEVICE,
    HAS_CUDA,
    interpreted_triton,
    random_tensor,
    triton_ops,
)

import kvkernels
from kvkernels import reference

SENTINEL = 7  # every cache slot starts here; a slot the store must skip keeps it


def _caches(kv_cache_dtype, num_blocks, block_size, num_kv_heads, head_dim, dtype):
    """(k_cache, v_cache, k_scale, v_scale) filled with SENTINEL, INT8 where ``kv_cache_dtype`` says."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_int8, v_int8 = kv_cache_dtype == "int8", kv_cache_dtype in ("int8", "int8_v")
    k_cache = torch.full(shape, SENTINEL, dtype=torch.int8 if k_int8 else dtype, device=DEVICE)
    v_cache = torch.full(shape, SENTINEL, dtype=torch.int8 if v_int8 else dtype, device=DEVICE)
    k_scale = torch.full(shape[:3], SENTINEL, dtype=torch.float32, device=DEVICE) if k_int8 else None
    v_scale = torch.full(shape[:3], SENTINEL, dtype=torch.float32, device=DEVICE) if v_int8 else None
    return k_cache, v_cache, k_scale, v_scale


def _new_tokens(num_tokens, num_kv_heads, head_dim, dtype, num_slots, generator):
    """k, v as strided views of one fused projection, and a slot mapping with some ``-1`` (skip) entries."""
    kv = random_tensor(num_tokens, 2 * num_kv_heads, head_dim, dtype=dtype, generator=generator) * 3
    k, v = kv.split([num_kv_heads, num_kv_heads], dim=1)
    slots = torch.randperm(num_slots, generator=generator)[:num_tokens]
    slots[torch.rand(num_tokens, generator=generator) < 0.25] = -1
    slots[0] = -1
    return k, v, slots.to(DEVICE)


def _store_both_ways(store, k, v, slots, caches, slot_dtype=torch.int64):
    """Run ``store`` and the reference on copies of ``caches``; return (kernel result, reference result)."""
    ours = [None if t is None else t.clone() for t in caches]
    expected = [None if t is None else t.clone() for t in caches]
    store(k, v, ours[0], ours[1], slots.to(slot_dtype), k_scale=ours[2], v_scale=ours[3])
    reference.store_kvcache(k, v, expected[0], expected[1], slots, k_scale=expected[2], v_scale=expected[3])
    return ours, expected


@pytest.mark.parametrize(
    "dtype,num_kv_heads,head_dim,block_size,slot_dtype",
    [
        pytest.param(torch.float16, 2, 64, 16, torch.int64, id="fp16-h2-d64-bs16"),
        pytest.param(torch.float32, 3, 128, 32, torch.int32, id="fp32-h3-d128-bs32-int32-slots"),
        pytest.param(torch.float16, 1, 96, 16, torch.int64, id="fp16-h1-d96"),
    ],
)
def test_store_writes_exactly_the_mapped_slots(dtype, num_kv_heads, head_dim, block_size, slot_dtype):
    generator = torch.Generator().manual_seed(0)
    num_blocks = 5
    k, v, slots = _new_tokens(40, num_kv_heads, head_dim, dtype, num_blocks * block_size, generator)
    caches = _caches("auto", num_blocks, block_size, num_kv_heads, head_dim, dtype)

    (k_cache, v_cache, _, _), (k_expected, v_expected, _, _) = _store_both_ways(
        triton_ops().store, k, v, slots, caches, slot_dtype
    )

    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)  # storing float KV is a copy
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    written[slots[slots >= 0]] = True
    assert (k_cache.flatten(0, 1)[~written] == SENTINEL).all()  # skipped and unmapped slots untouched
    assert torch.equal(k_cache.flatten(0, 1)[slots[slots >= 0]], k[slots >= 0])


@pytest.mark.parametrize("kv_cache_dtype", ["int8_v", "int8"])
def test_store_quantizes_like_the_reference(kv_cache_dtype):
    generator = torch.Generator().manual_seed(1)
    k, v, slots = _new_tokens(30, 2, 64, torch.float16, 4 * 16, generator)
    caches = _caches(kv_cache_dtype, 4, 16, 2, 64, torch.float16)

    ours, expected = _store_both_ways(triton_ops().store, k, v, slots, caches)

    for got, want in zip(ours, expected, strict=True):
        if got is None:
            continue
        if got.dtype == torch.int8 and HAS_CUDA:  # a GPU may round a value at a .5 tie the other way
            assert (got.int() - want.int()).abs().max() <= 1
        elif got.dtype == torch.float32 and HAS_CUDA:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        else:  # the interpreter follows the reference's IEEE arithmetic bit for bit
            assert torch.equal(got, want)
    # Dequantized values sit within half a quantization step of what was stored.
    v_cache, v_scale = ours[1], ours[3]
    kept = slots >= 0
    dequantized = v_cache.flatten(0, 1)[slots[kept]].float() * v_scale.flatten(0, 1)[slots[kept]][..., None]
    step = v_scale.flatten(0, 1)[slots[kept]][..., None]
    assert ((dequantized - v[kept].float()).abs() <= step / 2 + 1e-6).all()


def test_store_rounds_ties_to_even_like_torch_round():
    """absmax 127 gives scale 1.0 exactly, so x / scale lands on .5 ties that torch.round sends to even."""
    row = [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 3.4999998, -3.5000002, 0.0, -127.0, 64.5, 65.5, 7.0]
    k = torch.tensor(row, dtype=torch.float32, device=DEVICE).repeat(2, 1, 4)  # [2 tokens, 1 head, 64]
    slots = torch.tensor([3, 0], device=DEVICE)
    caches = _caches("int8", 1, 16, 1, 64, torch.float32)

    ours, expected = _store_both_ways(triton_ops().store, k, k.clone(), slots, caches)

    assert torch.equal(ours[0], expected[0]) and torch.equal(ours[2], expected[2])
    assert ours[0][0, 3, 0, :16].tolist() == [127, 0, 2, 2, 0, -2, -2, 126, -126, 3, -4, 0, -127, 64, 66, 7]


def test_store_of_nothing_is_a_no_op():
    generator = torch.Generator().manual_seed(2)
    k, v, _ = _new_tokens(3, 2, 64, torch.float16, 32, generator)
    caches = _caches("auto", 2, 16, 2, 64, torch.float16)
    skip_all = torch.full((3,), -1, dtype=torch.int64, device=DEVICE)

    triton_ops().store(k, v, caches[0], caches[1], skip_all)

    assert (caches[0] == SENTINEL).all() and (caches[1] == SENTINEL).all()


@pytest.mark.gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8_v", "int8"])
def test_store_16k_tokens_bf16_on_gpu(kv_cache_dtype):
    generator = torch.Generator().manual_seed(3)
    num_blocks, block_size = 1100, 16
    k, v, slots = _new_tokens(16384, 8, 128, torch.bfloat16, num_blocks * block_size, generator)
    caches = _caches(kv_cache_dtype, num_blocks, block_size, 8, 128, torch.bfloat16)

    assert kvkernels.use_triton(k.device)
    ours, expected = _store_both_ways(kvkernels.store_kvcache, k, v, slots, caches)

    for got, want in zip(ours, expected, strict=True):
        if got is not None and got.dtype == torch.int8:
            assert (got.int() - want.int()).abs().max() <= 1
        elif got is not None:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
