"""The KV pool: one allocation holding every layer's K and V pages.

The pool is a single flat byte buffer (one buffer = one shared-memory file or
one CUDA IPC handle when it is shared with another process) carved into typed
views. For layer ``l`` it holds, in order, each region padded to 256 bytes:

* ``k``: ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the K dtype
* ``v``: the same shape in the V dtype
* ``k_scale`` / ``v_scale``: ``[num_blocks, block_size, num_kv_heads]`` float32,
  present only for a cache stored as INT8.

With ``kv_cache_dtype="auto"`` both K and V use the model dtype and the layout
is exactly ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.
``int8_v`` stores V as INT8 with per-token, per-head scales (K stays in the
model dtype, where quantization hurts accuracy most); ``int8`` stores both.
"""

from __future__ import annotations

import mmap
import time
from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = ("auto", "int8_v", "int8")
_ALIGN = 256


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class KVCacheSpec:
    """Everything that fixes the pool's byte layout."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")

    @property
    def k_dtype(self) -> torch.dtype:
        return torch.int8 if self.kv_cache_dtype == "int8" else self.dtype

    @property
    def v_dtype(self) -> torch.dtype:
        return self.dtype if self.kv_cache_dtype == "auto" else torch.int8

    def region_bytes(self, num_blocks: int) -> list[tuple[str, int]]:
        """(name, padded bytes) of each region of one layer, in buffer order."""
        tokens = num_blocks * self.block_size
        elems = tokens * self.num_kv_heads * self.head_dim
        regions = [("k", elems * self.k_dtype.itemsize), ("v", elems * self.v_dtype.itemsize)]
        if self.k_dtype == torch.int8:
            regions.append(("k_scale", tokens * self.num_kv_heads * 4))
        if self.v_dtype == torch.int8:
            regions.append(("v_scale", tokens * self.num_kv_heads * 4))
        return [(name, _aligned(n)) for name, n in regions]

    def bytes_per_block(self) -> int:
        return self.num_layers * sum(n for _, n in self.region_bytes(1))

    def num_blocks_for_bytes(self, budget: int) -> int:
        return budget // self.bytes_per_block()

    def total_bytes(self, num_blocks: int) -> int:
        return self.num_layers * sum(n for _, n in self.region_bytes(num_blocks))


@dataclass
class LayerKV:
    """One layer's views into the pool, in the layout the kernels take."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


def _zeroed_bytes(nbytes: int, device: torch.device | str) -> torch.Tensor:
    """``nbytes`` zero bytes on ``device``. On a CPU they come from an anonymous mapping, whose pages the kernel
    gives zeroed on first touch: a pool of a GiB costs nothing until its blocks are used (``torch.zeros`` wrote
    every page up front, 0.5 to 2 s a GiB here), and the process's resident memory is the blocks it used."""
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)  # (the tensor keeps the mapping alive)


class KVCache:
    """Allocates the pool (or wraps a given byte buffer) and exposes per-layer views."""

    def __init__(
        self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str, buffer: torch.Tensor | None = None
    ) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        nbytes = spec.total_bytes(num_blocks)
        if buffer is None:
            buffer = _zeroed_bytes(nbytes, device)
        elif buffer.dtype != torch.uint8 or buffer.numel() != nbytes:
            raise ValueError(f"KV buffer must be {nbytes} uint8 bytes, got {buffer.numel()} of {buffer.dtype}")
        self.buffer = buffer
        self.layers = self._carve()

    def _carve(self) -> list[LayerKV]:
        spec, n = self.spec, self.num_blocks
        shapes = {
            "k": ((n, spec.block_size, spec.num_kv_heads, spec.head_dim), spec.k_dtype),
            "v": ((n, spec.block_size, spec.num_kv_heads, spec.head_dim), spec.v_dtype),
            "k_scale": ((n, spec.block_size, spec.num_kv_heads), torch.float32),
            "v_scale": ((n, spec.block_size, spec.num_kv_heads), torch.float32),
        }
        layers, offset = [], 0
        for _ in range(spec.num_layers):
            views = {}
            for name, nbytes in spec.region_bytes(n):
                shape, dtype = shapes[name]
                count = 1
                for d in shape:
                    count *= d
                raw = self.buffer[offset : offset + count * dtype.itemsize]
                views[name] = raw.view(dtype).view(shape)
                offset += nbytes
            layers.append(LayerKV(views["k"], views["v"], views.get("k_scale"), views.get("v_scale")))
        return layers

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()


def copy_blocks(src: list[LayerKV], src_blocks: list[int], dst: list[LayerKV], dst_blocks: list[int],
                until: float | None = None) -> bool:  # fmt: skip
    """Copy whole blocks (every layer's K, V and INT8 scales) from one pool's views into another's of the same
    layout: block ``src_blocks[i]`` of ``src`` becomes block ``dst_blocks[i]`` of ``dst``.

    With ``until`` (a ``time.monotonic()`` instant) each layer is copied only while that instant is ahead:
    False when the copy stopped short at it (later layers untouched), True when everything was copied."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"copying {len(src_blocks)} blocks into {len(dst_blocks)}")
    src_index = torch.tensor(src_blocks, device=src[0].k_cache.device)
    dst_index = torch.tensor(dst_blocks, device=dst[0].k_cache.device)
    for s, d in zip(src, dst, strict=True):
        if until is not None and time.monotonic() >= until:
            return False
        for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
            source, target = getattr(s, name), getattr(d, name)
            if source is not None:
                target.index_copy_(0, dst_index, source.index_select(0, src_index).to(target.device))
    return True
