"""Paged-attention kernels: Triton on CUDA (or under ``TRITON_INTERPRET=1``), PyTorch references otherwise."""

from kernels.reference import paged_decode_attention, paged_prefill_attention, store_kvcache

__all__ = ["paged_decode_attention", "paged_prefill_attention", "store_kvcache"]
