"""A worker's whole KV pool when its heads are split over tensor-parallel ranks: ``SplitPool``.

Under tensor parallelism each rank's pool (``kvstore.kv_cache``) holds a contiguous range of the KV heads of
the same blocks (``engine.models.tensor_parallel.Shard``). On the CPU every rank's part lives in a
shared-memory file that rank 0 maps too (``engine.tensor_parallel_ranks``), so rank 0 sees the whole pool
as its parts in head order; an unsplit pool is one part.

What moves between workers is whole heads, whatever the two sides' splits:

* ``copy_blocks`` copies blocks from one split pool into another, each part's heads from the source parts
  that hold them (a prefill worker at one TP size writing a decode worker's pool at another, in place);
* the hand-off's bytes (``transfer.blocks``) are the bytes an unsplit pool of the same model would hold
  (region-major, each token's row of all heads in order), so the ``grpc`` stream and the checksum that both
  ends compare are the same for every split: the checksum covers every rank's part.

``layout`` (the heads of each part) is what a worker advertises beside its TP size; two pools are
interchangeable when their unsplit specs are equal (``kvstore.layout.fingerprint`` of ``spec``).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from kvstore.kv_cache import KVCache, KVCacheSpec

_REGIONS = ("k_cache", "v_cache", "k_scale", "v_scale")


class SplitPool:
    """The parts of one pool, in head order: part ``i`` holds KV heads ``[firsts[i], firsts[i] + heads[i])`` of
    every block (see the module's docstring)."""

    def __init__(self, parts: list[KVCache]) -> None:
        if not parts:
            raise ValueError("a split pool needs at least one part")
        first = parts[0]
        for part in parts[1:]:
            if (part.num_blocks, dataclasses.replace(part.spec, num_kv_heads=first.spec.num_kv_heads)) != (
                    first.num_blocks, first.spec):  # fmt: skip
                raise ValueError("the parts of a split pool must differ in their KV heads only")
        self.parts = parts
        self.heads = tuple(p.spec.num_kv_heads for p in parts)
        self.firsts = tuple(sum(self.heads[:i]) for i in range(len(parts)))
        self.spec: KVCacheSpec = dataclasses.replace(first.spec, num_kv_heads=sum(self.heads))  # the unsplit pool's
        self.num_blocks = first.num_blocks
        self.device = first.buffer.device

    @staticmethod
    def of(pool: KVCache | SplitPool) -> SplitPool:
        """``pool`` as a split pool (an unsplit ``KVCache`` is one part)."""
        return pool if isinstance(pool, SplitPool) else SplitPool([pool])

    @property
    def layout(self) -> str:
        """The heads of each part, e.g. ``"2,1"``: what a worker advertises (``WorkerInfo.kv_heads``)."""
        return ",".join(map(str, self.heads))

    @property
    def split(self) -> bool:
        return len(self.parts) > 1

    @property
    def ipc_parts(self) -> bool:
        """Whether parts of this pool are other processes' GPU memory, opened here through CUDA IPC (a split GPU
        pool: each rank's part is its own, ``kvstore.ipc_pool``). NIXL is not asked to register such parts."""
        return self.split and self.device.type == "cuda"

    def synchronize(self) -> None:
        """Wait for this process's copies into a pool of ``ipc_parts``, whose owners' next kernels do not wait
        for streams of ours."""
        if self.ipc_parts:
            for part in self.parts:
                torch.cuda.synchronize(part.buffer.device)

    def regions(self) -> list[list[torch.Tensor]]:
        """Every layer's K, V (and scale) region in ``transfer.blocks``' order, each as its parts' views of
        ``(num_blocks, block_size, bytes of the part's heads in one token's row)`` uint8, in head order."""
        out = []
        for layers in zip(*(p.layers for p in self.parts), strict=True):
            for name in _REGIONS:
                views = [getattr(layer, name) for layer in layers]
                if views[0] is not None:
                    out.append([_token_rows(v) for v in views])
        return out


def parse_layout(kv_heads: str, num_kv_heads: int, num_parts: int) -> list[int]:
    """The heads of each part from a worker's advertised ``kv_heads`` ('' for one part); ``ValueError`` when they
    do not split ``num_kv_heads`` heads into ``num_parts`` parts of at least one head."""
    try:
        heads = [int(h) for h in kv_heads.split(",")] if kv_heads else [num_kv_heads]
    except ValueError:
        heads = []
    if not heads or min(heads) < 1 or sum(heads) != num_kv_heads or len(heads) != num_parts:
        raise ValueError(f"the destination's KV heads {kv_heads!r} (in {num_parts} parts) cannot be mapped onto this "
                         f"model's {num_kv_heads} KV heads")  # fmt: skip
    return heads


def _token_rows(t: torch.Tensor) -> torch.Tensor:
    """A region ``(blocks, block_size, heads[, head_dim])`` as ``(blocks, block_size, bytes)`` uint8."""
    return t.view(t.shape[0], t.shape[1], -1).view(torch.uint8)


def _overlaps(src: SplitPool, dst: SplitPool) -> list[tuple[int, int, int, int, int]]:
    """``(source part, destination part, first head in the source part, in the destination part, heads)``
    for every pair of parts that hold heads in common."""
    pairs = []
    for i, (s_first, s_heads) in enumerate(zip(src.firsts, src.heads, strict=True)):
        for j, (d_first, d_heads) in enumerate(zip(dst.firsts, dst.heads, strict=True)):
            lo, hi = max(s_first, d_first), min(s_first + s_heads, d_first + d_heads)
            if lo < hi:
                pairs.append((i, j, lo - s_first, lo - d_first, hi - lo))
    return pairs


def copy_blocks(src: SplitPool, src_blocks: list[int], dst: SplitPool, dst_blocks: list[int],
                until: float | None = None) -> bool:  # fmt: skip
    """Copy whole blocks (every layer's K, V and INT8 scales, every head) from one split pool into another of
    the same unsplit spec, whatever either's split: block ``src_blocks[i]`` of ``src`` becomes block
    ``dst_blocks[i]`` of ``dst``, each destination part's heads taken from the source parts that hold them.

    With ``until`` (a ``time.monotonic()`` instant) each layer is copied only while that instant is ahead:
    False when the copy stopped short at it (later layers untouched), True when everything was copied."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"copying {len(src_blocks)} blocks into {len(dst_blocks)}")
    if src.spec != dst.spec:
        raise ValueError(f"KV layouts differ: {src.spec} against {dst.spec}")
    # each part's ids on its own device (on a GPU, the ranks' parts are on theirs: ``kvstore.ipc_pool``)
    src_index = [torch.tensor(src_blocks, device=part.buffer.device) for part in src.parts]
    dst_index = [torch.tensor(dst_blocks, device=part.buffer.device) for part in dst.parts]
    pairs = _overlaps(src, dst)
    for layer in range(src.spec.num_layers):
        if until is not None and time.monotonic() >= until:
            return False
        for name in _REGIONS:
            for i, j, s_at, d_at, n in pairs:
                source = getattr(src.parts[i].layers[layer], name)
                if source is None:
                    continue
                target = getattr(dst.parts[j].layers[layer], name)
                if n != src.heads[i] or n != dst.heads[j]:  # (heads are dim 2 of every region)
                    source, target = source[:, :, s_at : s_at + n], target[:, :, d_at : d_at + n]
                target.index_copy_(0, dst_index[j], source.index_select(0, src_index[i]).to(target.device))
    dst.synchronize()
    return True
