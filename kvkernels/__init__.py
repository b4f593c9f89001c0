"""Model kernels: Triton on CUDA (or under ``TRITON_INTERPRET=1``), PyTorch references otherwise; on the CPU,
decode attention over float32 pools runs a small C kernel where a compiler is at hand (``cpu_decode``).

``_implementation`` is the one place that picks the backend. Triton modules are
imported on first use, so ``import kvkernels`` works where Triton is not
installed (then the references always run). Note that Triton decides between
compiling and interpreting when a kernel module is *imported*: set
``TRITON_INTERPRET=1`` before the first Triton call in a process.

The package is ``kvkernels``, not ``kernels``: that is the import name of Hugging Face's ``kernels``, which
transformers installs and imports (tests/unit/test_package_names.py).
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

from kvkernels import cpu_decode, reference

__all__ = [
    "add_rms_norm",
    "gumbel_argmax",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rotary_embedding",
    "silu_and_mul",
    "store_kvcache",
    "use_triton",
]

_TRITON_MODULES = {
    "paged_decode_attention": "kvkernels.decode_attention",
    "paged_prefill_attention": "kvkernels.prefill_attention",
    "store_kvcache": "kvkernels.store_kv",
    "add_rms_norm": "kvkernels.norm",
    "rotary_embedding": "kvkernels.rotary",
    "silu_and_mul": "kvkernels.activation",
    "gumbel_argmax": "kvkernels.sampling",
}


@functools.cache
def _triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(device: torch.device) -> bool:
    """Whether tensors on ``device`` go to the Triton kernels (CUDA, or any device when interpreting)."""
    interpret = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on")
    return (device.type == "cuda" or interpret) and _triton_installed()


def _implementation(name: str, device: torch.device):
    if use_triton(device):
        return getattr(importlib.import_module(_TRITON_MODULES[name]), name)
    return getattr(reference, name)


def _check_int8(cache: torch.Tensor, scale: torch.Tensor | None, name: str) -> None:
    if (cache.dtype == torch.int8) != (scale is not None):
        raise ValueError(f"{name}: an int8 cache needs its scales and only an int8 cache takes them")


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    q_sink: torch.Tensor | None = None,
    ring: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged KV; see ``reference.paged_decode_attention``
    (``ring``, with ``q_sink``: over each sequence's sinks and window only)."""
    _check_int8(k_cache, k_scale, "k_cache")
    _check_int8(v_cache, v_scale, "v_cache")
    if ring is None and k_scale is None and not use_triton(q.device) and cpu_decode.applies(q, k_cache, v_cache):
        return cpu_decode.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    impl = _implementation("paged_decode_attention", q.device)
    window = {} if ring is None else {"q_sink": q_sink, "ring": ring}
    return impl(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale=k_scale, v_scale=v_scale, **window)


def paged_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    max_q_len: int | None = None,
    q_sink: torch.Tensor | None = None,
    ring: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens over a cached prefix; see ``reference.paged_prefill_attention``
    (``ring``, with ``q_sink``: over each sequence's sinks and window only).

    ``max_q_len``, the most new tokens of any sequence when the caller knows it, spares the Triton kernel a
    read-back to size its grid (the reference walks the lengths on the host anyway and takes no hint)."""
    _check_int8(k_cache, k_scale, "k_cache")
    _check_int8(v_cache, v_scale, "v_cache")
    impl = _implementation("paged_prefill_attention", q.device)
    hint = {"max_q_len": max_q_len} if use_triton(q.device) else {}
    window = {} if ring is None else {"q_sink": q_sink, "ring": ring}
    return impl(
        q, k, v, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
        k_scale=k_scale, v_scale=v_scale, **hint, **window,
    )  # fmt: skip


def store_kvcache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write new tokens' K/V into their slots in place (``-1`` = skip); see ``reference.store_kvcache``."""
    _check_int8(k_cache, k_scale, "k_cache")
    _check_int8(v_cache, v_scale, "v_cache")
    if k_scale is None and v_scale is None and not use_triton(k.device) and \
            cpu_decode.stores(k, v, k_cache, v_cache, slot_mapping):  # fmt: skip
        return cpu_decode.store_kv(k, v, k_cache, v_cache, slot_mapping)
    impl = _implementation("store_kvcache", k.device)
    impl(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual) * weight, x + residual)`` in one pass; see ``reference.add_rms_norm``."""
    return _implementation("add_rms_norm", x.device)(x, residual, weight, eps)


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of q and k with per-token ``cos_sin``, as new tensors; see ``reference.rotary_embedding``."""
    return _implementation("rotary_embedding", q.device)(q, k, cos_sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a fused ``(tokens, 2 * I)`` gate/up output; see ``reference.silu_and_mul``."""
    return _implementation("silu_and_mul", gate_up.device)(gate_up)


def gumbel_argmax(scaled_logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One token per row of ``scaled_logits (rows, vocab)`` float32 with the counter-based noise of ``seeds``
    and ``positions`` ``(rows,)`` int64 -> ``(rows,)`` int64; see ``reference.gumbel_argmax``."""
    return _implementation("gumbel_argmax", scaled_logits.device)(scaled_logits, seeds, positions)
