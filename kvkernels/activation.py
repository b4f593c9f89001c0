"""Triton SwiGLU activation: ``silu(gate) * up`` straight from the fused gate/up projection, in one launch.

Program ``(token, block)`` reads ``BLOCK`` columns of the gate half and the
same columns of the up half of one token's row and writes ``BLOCK`` outputs.
Rounding follows ``reference.silu_and_mul`` (PyTorch's ``F.silu(gate) * up``):
``silu`` in float32 rounded to the model dtype, then the product rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024  # columns per program: 8 per thread at 4 warps


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,  # [num_tokens, 2 * INTERMEDIATE]: gate columns, then up columns
    out_ptr,  # [num_tokens, INTERMEDIATE]
    stride_in,
    stride_out,
    INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < INTERMEDIATE
    row = gate_up_ptr + token * stride_in
    gate = tl.load(row + cols, mask=col_ok, other=0.0).to(tl.float32)
    up = tl.load(row + INTERMEDIATE + cols, mask=col_ok, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + token * stride_out + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=col_ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton twin of ``reference.silu_and_mul``: ``(num_tokens, 2 * I)`` -> new ``(num_tokens, I)``."""
    num_tokens, width = gate_up.shape
    if width % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"gate_up needs an even, contiguous last dimension (got {width}, stride "
                         f"{gate_up.stride(-1)})")  # fmt: skip
    intermediate = width // 2
    out = torch.empty(num_tokens, intermediate, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(intermediate))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(intermediate, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), INTERMEDIATE=intermediate, BLOCK=block, num_warps=4,
    )  # fmt: skip
    return out
