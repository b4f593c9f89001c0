"""Shared set-up for the kernel tests, which always execute the Triton kernels.

With CUDA the kernels are compiled and run on the GPU. Without it the
``interpreted_triton`` fixture sets ``TRITON_INTERPRET=1`` while a kernel test
module runs (Triton reads it when it, or a kernel module, is imported *and*
when a kernel launches) and removes it afterwards, so other modules keep the fast
reference path. Test modules import that fixture from here: ``tests/conftest.py``
is the suite's one conftest.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from kvkernels import reference

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module", autouse=True)
def interpreted_triton():
    """``TRITON_INTERPRET=1`` for the duration of the importing test module when there is no GPU."""
    if HAS_CUDA:
        pytest.importorskip("triton")
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        pytest.importorskip("triton")
        yield


_KERNEL_MODULES = ("kvkernels.tiles", "kvkernels.store_kv", "kvkernels.decode_attention", "kvkernels.prefill_attention",
                   "kvkernels.norm", "kvkernels.rotary", "kvkernels.activation", "kvkernels.sampling")  # fmt: skip


def _import_interpreted_triton() -> None:
    """Make sure Triton and the kernel modules were imported in interpreter mode, or skip.

    Triton decides between compiling and interpreting every ``@triton.jit``
    function, its own standard library (``tl.cdiv``, ``tl.sum``...) included,
    when the defining module is imported. Kernel modules imported too early
    are reloaded; Triton itself cannot be (its native extension aborts).
    """
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import KernelInterface

    if not isinstance(tl.standard.cdiv, InterpretedFunction):
        pytest.skip("Triton was imported without TRITON_INTERPRET=1 earlier in this process: "
                    "run `pytest tests/kernels` on its own, or with TRITON_INTERPRET=1 set")  # fmt: skip
    for name in _KERNEL_MODULES:  # dependencies first
        module = importlib.import_module(name)
        kernels = [fn for fn in vars(module).values() if isinstance(fn, KernelInterface)]
        if not all(isinstance(fn, InterpretedFunction) for fn in kernels):
            importlib.reload(module)


def triton_ops() -> SimpleNamespace:
    """The Triton implementations; on CPU, interpreted ones (compiled kernels cannot run there).

    Call it inside a test, where the ``interpreted_triton`` fixture is active.
    """
    if not HAS_CUDA:
        _import_interpreted_triton()
    store, decode, prefill = (importlib.import_module(name) for name in _KERNEL_MODULES[1:4])
    return SimpleNamespace(
        decode=decode.paged_decode_attention,
        prefill=prefill.paged_prefill_attention,
        store=store.store_kvcache,
        choose_num_splits=decode.choose_num_splits,
        kernels=(decode._decode_split_kernel, decode._decode_reduce_kernel, prefill._prefill_kernel,
                 store._store_kvcache_kernel),
    )  # fmt: skip


def quantized(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cache [blocks, block_size, heads, dim]`` -> (int8 cache, float32 scales ``[blocks, block_size, heads]``)."""
    values, scales = reference.quantize_int8(cache.flatten(0, 1))
    return values.view(cache.shape), scales.view(cache.shape[:3])


def make_paged_kv(
    seq_lens: list[int],
    *,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    generator: torch.Generator,
    kv_cache_dtype: str = "auto",
    device: torch.device = DEVICE,
) -> SimpleNamespace:
    """Random paged K/V holding ``seq_lens`` tokens, behind a shuffled, non-contiguous block table.

    Returns the full-precision caches (``k_cache``, ``v_cache``), the caches
    as ``kv_cache_dtype`` stores them (``k``, ``v``, ``k_scale``, ``v_scale``:
    ``int8_v`` quantizes V, ``int8`` both), ``block_tables`` (int32; past each
    sequence's last block, out-of-range garbage that must never be read) and
    ``seq_lens`` (int32).
    """
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks that belong to nobody
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    order = torch.randperm(num_blocks, generator=generator)
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq) + 1), num_blocks + 1000, dtype=torch.int32)
    block_tables[:, -1] = -1
    used = 0
    for i, count in enumerate(blocks_per_seq):
        block_tables[i, :count] = order[used : used + count]
        used += count
    k, v, k_scale, v_scale = k_cache, v_cache, None, None
    if kv_cache_dtype == "int8":
        k, k_scale = quantized(k_cache)
    if kv_cache_dtype in ("int8", "int8_v"):
        v, v_scale = quantized(v_cache)

    def to_device(t):
        return None if t is None else t.to(device)

    return SimpleNamespace(
        k_cache=to_device(k_cache), v_cache=to_device(v_cache), k=to_device(k), v=to_device(v),
        k_scale=to_device(k_scale), v_scale=to_device(v_scale), block_tables=to_device(block_tables),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )  # fmt: skip


def random_tensor(*shape: int, dtype: torch.dtype, generator: torch.Generator, device=DEVICE) -> torch.Tensor:
    return torch.randn(shape, generator=generator).to(dtype).to(device)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Kernel vs reference at the precision of the kernel's dtype (the reference computes in float32)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tolerance = TOLERANCE[actual.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance, rtol=tolerance)
