"""Triton residual-add + RMSNorm in one pass: each row is read once and written at most twice.

A decoder layer ends its attention and its MLP with ``residual += out`` and
then normalizes the sum for the next block; one launch here replaces the add
and the half-dozen elementwise launches of a PyTorch RMSNorm. One program
owns one token's row, held whole in registers (``BLOCK >= hidden``; 8 warps
keep 32 float32 values per thread at hidden 8192). Numerics are those of
``reference.add_rms_norm``: the sum is rounded to the model dtype (as
``x + residual`` would be), normalized in float32, rounded again, then scaled by
the weight with one more rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # [num_tokens, HIDDEN]
    residual_ptr,  # [num_tokens, HIDDEN] (HAS_RESIDUAL only)
    weight_ptr,  # [HIDDEN]
    out_ptr,  # [num_tokens, HIDDEN]
    residual_out_ptr,  # [num_tokens, HIDDEN], receives x + residual (HAS_RESIDUAL only)
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=col_ok, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=col_ok, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=col_ok)
    x = x.to(tl.float32)
    mean_square = tl.sum(x * x, 0) / HIDDEN  # padded columns hold 0 and add nothing
    normed = (x * tl.math.rsqrt(mean_square + eps)).to(out_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=col_ok, other=0.0)
    out = normed.to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=col_ok)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of ``reference.add_rms_norm``: returns ``(normed, x + residual)``, both new tensors.

    Without a residual the second result is ``x`` itself (no copy).
    """
    num_tokens, hidden = x.shape
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1) or not weight.is_contiguous():
        raise ValueError("x, residual and weight need a contiguous last dimension")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    residual_out = x if residual is None else torch.empty_like(out)
    if num_tokens == 0:
        return out, residual_out
    block = triton.next_power_of_2(hidden)
    source = residual if residual is not None else x  # placeholder keeps the argument list fixed
    _add_rms_norm_kernel[(num_tokens,)](
        x, source, weight, out, residual_out,
        x.stride(0), source.stride(0), out.stride(0), residual_out.stride(0), eps,
        HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None,
        num_warps=min(max(block // 256, 1), 8),
    )  # fmt: skip
    return out, residual_out
