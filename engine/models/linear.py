"""``Linear``: ``nn.Linear`` whose products run at the CPU's speed.

On the CPU a float32 ``Linear`` keeps a copy of its weight in oneDNN's blocked layout (``pack_for_onednn``),
and its eager products of any number of rows go to oneDNN over that copy (numbers in that function's
docstring). The rest of this docstring is about where nothing is packed, and the compiled decode step.

A decode step multiplies a few rows (one per sequence) by each weight matrix: a matrix-vector product that
reads the whole weight and does two FLOPs per element read, so it runs at the memory's speed. PyTorch's CPU
``F.linear`` hands it to MKL's GEMV, which runs it on one thread: the bundled model's LM head took 12.7 ms on
one thread and on two (8.6 GB/s), where two threads read memory at about 32 GB/s here. The same product as a
``bmm`` over ``k`` blocks of the weight's rows runs the blocks on the threads (6.2 ms, 18 GB/s): each output
element is the same dot product over the same inputs, computed by the same kernel on each block.

Used where the rows are few (``SPLIT_MAX_ROWS``: a decode step's), on the CPU, with more than one thread. Inside
a compiled one-sequence decode step (``engine.models.compiled_decode.CompiledDecode``) inductor turns the same one-row
``bmm`` into a reduction of its own, parallel over the blocks, with no call into the BLAS; the thread count is
then the one fixed at compile time (``compile_threads``), since reading it would break the graph.

Unpacked, many rows (a prefill's) go to ``F.linear``. (oneDNN's matrix product over the unpacked weight, used
for them before packing, gave 166-179 GFLOP/s against MKL's 122-145 on the bundled model's shapes with 256
rows; packed gives 196.) CUDA goes to ``F.linear`` unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SPLIT_MAX_ROWS = 64  # up to here split products were faster (1.15-1.7x on a 2-core host); not a prefill's
BLOCKS_PER_THREAD = 4  # blocks of the weight's rows per thread: balances uneven cores
compile_threads = 1  # the threads a compiled decode step splits for (set by ``CompiledDecode`` before it compiles)


class Linear(nn.Linear):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.packed: torch.Tensor | None = None  # the weight in oneDNN's blocked layout (``pack_for_onednn``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (a compiled step never reads ``packed``: dynamo would have to trace an opaque-layout tensor)
        if not torch.compiler.is_compiling() and self.packed is not None and x.dim() == 2:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        blocks = split_blocks(x, self.weight)
        if blocks > 1:
            return split_linear(x, self.weight, self.bias, blocks)
        return F.linear(x, self.weight, self.bias)


def split_blocks(x: torch.Tensor, weight: torch.Tensor) -> int:
    """How many row blocks of ``weight`` to multiply ``x`` by at once (1: plain ``F.linear``)."""
    threads = compile_threads if torch.compiler.is_compiling() else torch.get_num_threads()
    if x.device.type != "cpu" or threads < 2 or x.dim() != 2 or x.shape[0] > SPLIT_MAX_ROWS:
        return 1
    blocks = threads * BLOCKS_PER_THREAD
    while blocks > 1 and weight.shape[0] % blocks:
        blocks //= 2
    return blocks


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, blocks: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as one ``bmm`` of ``x`` by ``blocks`` blocks of ``weight``'s rows."""
    rows, out = x.shape[0], weight.shape[0]
    per_block = weight.view(blocks, out // blocks, weight.shape[1]).transpose(1, 2)  # (blocks, in, out / blocks)
    y = torch.bmm(x.unsqueeze(0).expand(blocks, rows, x.shape[1]), per_block)  # (blocks, rows, out / blocks)
    y = y.transpose(0, 1).reshape(rows, out)
    return y if bias is None else y + bias


def pack_for_onednn(model: nn.Module) -> int:
    """Give every float32 ``Linear`` of ``model`` on the CPU a copy of its weight in oneDNN's blocked layout
    (``torch.ops.mkldnn._reorder_linear_weight``, what inductor's weight freezing does), which eager products of
    any number of rows then use; returns the bytes the copies take (0 without oneDNN).

    oneDNN reads a packed weight without reordering it on every call. On the bundled model's weights, two
    threads, one run alternating the sides: 8 rows 21 against 34 ms unpacked, 64 rows 82 against 115, 256
    rows 277 against 326 (165-196 GFLOP/s), and 16 rows 35 ms against 55 for the split ``bmm``; the same
    bits as the unpacked oneDNN product from 2 rows on. The plain weight stays: the compiled one-sequence
    decode step reads it, and a tied LM head shares it with the embedding."""
    if not torch.backends.mkldnn.is_available():
        return 0
    nbytes = 0
    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, Linear):
                continue
            weight = module.weight.detach()
            if weight.device.type == "cpu" and weight.dtype == torch.float32:
                module.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 16)
                nbytes += weight.numel() * weight.element_size()
    return nbytes
