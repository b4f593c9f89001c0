"""Shared set-up for the kernel tests: they always execute the Triton kernels.

On a machine with CUDA the kernels are compiled and run on the GPU; elsewhere
``TRITON_INTERPRET=1`` is set while each kernel test module runs (and removed
afterwards, so other test modules keep the fast reference path), and the
kernel modules are imported under it, which makes Triton interpret them.
"""

from __future__ import annotations

import importlib
import os
from types import SimpleNamespace

import pytest
import torch

from kernels import reference

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module", autouse=True)
def triton_interpreter():
    """``TRITON_INTERPRET=1`` for the duration of the module when there is no GPU."""
    pytest.importorskip("triton")
    if HAS_CUDA:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        yield


@pytest.fixture(scope="module")
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(scope="module")
def triton_ops(triton_interpreter):
    """The Triton implementations, checked to be interpreted on CPU (compiled kernels cannot run there)."""
    decode = importlib.import_module("kernels.decode_attention")
    prefill = importlib.import_module("kernels.prefill_attention")
    store = importlib.import_module("kernels.store_kv")
    if not HAS_CUDA:
        from triton.runtime.interpreter import InterpretedFunction

        assert os.environ["TRITON_INTERPRET"] == "1"
        for kernel in (decode._decode_split_kernel, prefill._prefill_kernel, store._store_kvcache_kernel):
            assert isinstance(kernel, InterpretedFunction), "kernels were imported before TRITON_INTERPRET=1 was set"
    return SimpleNamespace(
        decode=decode.paged_decode_attention, prefill=prefill.paged_prefill_attention, store=store.store_kvcache
    )


def _quantized(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cache [blocks, block_size, heads, dim]`` -> (int8 cache, float32 scales ``[blocks, block_size, heads]``)."""
    values, scales = reference.quantize_int8(cache.flatten(0, 1))
    return values.view(cache.shape), scales.view(cache.shape[:3])


@pytest.fixture
def make_paged_kv(device):
    """Factory: random paged K/V for ``seq_lens`` with a shuffled, non-contiguous block table.

    Returns a namespace with the full-precision caches (``k_cache``, ``v_cache``),
    the caches for ``kv_cache_dtype`` (``k``, ``v``, ``k_scale``, ``v_scale``:
    ``int8_v`` quantizes V, ``int8`` both), ``block_tables`` (int32, one spare
    column of out-of-range garbage past every sequence's last block) and
    ``seq_lens`` (int32).
    """

    def make(seq_lens, *, block_size, num_kv_heads, head_dim, dtype, kv_cache_dtype="auto", generator=None):
        blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
        num_blocks = sum(blocks_per_seq) + 3  # a few blocks owned by nobody
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k_cache = torch.randn(shape, generator=generator).to(dtype)
        v_cache = torch.randn(shape, generator=generator).to(dtype)
        order = torch.randperm(num_blocks, generator=generator)
        width = max(blocks_per_seq) + 1
        block_tables = torch.full((len(seq_lens), width), num_blocks + 1000, dtype=torch.int32)
        block_tables[:, -1] = -1
        used = 0
        for i, count in enumerate(blocks_per_seq):
            block_tables[i, :count] = order[used : used + count]
            used += count
        k, v, k_scale, v_scale = k_cache, v_cache, None, None
        if kv_cache_dtype == "int8":
            k, k_scale = _quantized(k_cache)
        if kv_cache_dtype in ("int8", "int8_v"):
            v, v_scale = _quantized(v_cache)
        to = {"device": device}
        return SimpleNamespace(
            k_cache=k_cache.to(**to), v_cache=v_cache.to(**to),
            k=k.to(**to), v=v.to(**to),
            k_scale=None if k_scale is None else k_scale.to(**to),
            v_scale=None if v_scale is None else v_scale.to(**to),
            block_tables=block_tables.to(**to),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        )  # fmt: skip

    return make


@pytest.fixture
def assert_matches():
    """Kernel vs reference at the precision of the kernel's dtype (the reference computes in float32)."""

    def check(actual: torch.Tensor, expected: torch.Tensor) -> None:
        tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[actual.dtype]
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance, rtol=tolerance)

    return check
