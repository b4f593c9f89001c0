"""``BlockCopier``: whole blocks between a device pool and a host tier's pool (``kvstore.host_tier``).

A pool is one buffer of regions (each layer's K, V and scales, ``kvstore.kv_cache``), and a block is one row
of each region. Seen as rows of a common byte width (``_RowGroup``: one per width its regions have, one for
a model-dtype cache), every block of every region is a run of consecutive rows of one tensor, so a batch of
blocks moves in one gather and one scatter per width, however many layers, blocks and slots: synchronously
on a CPU; on a GPU on a copy stream of its own (``wait_for_copies`` orders the compute stream after it,
``synchronize`` the host), through one pinned staging buffer. A store gathers on the device, copies, and
scatters into the slots on the host once its copy has landed (``synchronize``, or the next call that finds
it landed); a load gathers the slots on the host, copies, and scatters on the device. Large batches into a
few runs of consecutive slots instead copy each region's run straight into the tier (no host scatter).

On an H200 (``kvserve bench tiers``, 16-1,024 scattered blocks of a Qwen2-0.5B, 48 regions) one copy per
block and region ran at 0.2-0.4 GB/s against 33-55 GB/s for a plain copy of the same bytes, and one gather,
copy and scatter per region at 0.04-0.45x plain, launch-bound at small batches; one per width is not yet
measured there. On this project's 2-core CPU it moved 16 blocks at 0.16x plain where one per region did 0.09x.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.kv_cache import LayerKV

_REGIONS = ("k_cache", "v_cache", "k_scale", "v_scale")
_INTS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@dataclass(frozen=True)
class _RowGroup:
    """The regions of one byte width: the pool's whole buffer as rows of ``rows.shape[1]`` elements, and for
    each region (in layer order) its first row; a block is ``per_block`` consecutive rows of a region."""

    rows: torch.Tensor
    firsts: torch.Tensor  # int64, on the pool's device
    per_block: int

    def index(self, blocks: torch.Tensor) -> torch.Tensor:
        """The rows of ``blocks`` (int64, on the pool's device) in every region: region, block, row order."""
        within = torch.arange(self.per_block, device=blocks.device)
        return (self.firsts[:, None, None] + blocks[None, :, None] * self.per_block + within).reshape(-1)


def _regions(views: list[LayerKV]) -> dict[int, list[int]]:
    """The byte offset in the buffer of each region of ``views``, by width (bytes a block), in layer order."""
    storage = views[0].k_cache.untyped_storage()
    regions: dict[int, list[int]] = {}
    for layer in views:
        for name in _REGIONS:
            region = getattr(layer, name)
            if region is None:
                continue
            if region.untyped_storage().data_ptr() != storage.data_ptr() or not region.is_contiguous():
                raise ValueError("BlockCopier: a pool's regions must be contiguous views of one buffer")
            width = region[0].numel() * region.element_size()
            regions.setdefault(width, []).append(region.storage_offset() * region.element_size())
    return regions


def _row_groups(a: list[LayerKV], b: list[LayerKV]) -> list[tuple[_RowGroup, _RowGroup]]:
    """Two pools of one spec (of any sizes) as pairs of ``_RowGroup``, one pair per region width, in order
    of first appearance. A pair's row is the largest that divides its width and every one of its regions'
    offsets in both buffers (regions are padded to 256 bytes: a whole block row, or 128 bytes of a small
    scale region), so a block is the same number of rows on both sides."""
    ours, theirs = _regions(a), _regions(b)
    if [(w, len(o)) for w, o in ours.items()] != [(w, len(o)) for w, o in theirs.items()]:
        raise ValueError("BlockCopier: the two pools' layouts differ")
    pairs = []
    for width, offsets in ours.items():
        row = math.gcd(width, *offsets, *theirs[width])
        itemsize = next(w for w in (8, 4, 2, 1) if row % w == 0)
        pair = []
        for views, at in ((a, offsets), (b, theirs[width])):
            flat = torch.empty(0, dtype=torch.uint8, device=views[0].k_cache.device)
            flat.set_(views[0].k_cache.untyped_storage())
            rows = flat[: flat.numel() // row * row].view(_INTS[itemsize]).view(-1, row // itemsize)
            pair.append(_RowGroup(rows, torch.tensor([o // row for o in at], device=flat.device), width // row))
        pairs.append((pair[0], pair[1]))
    return pairs


def _pieces(views: list[LayerKV]) -> list[torch.Tensor]:
    """Every region of every layer as ``(num_blocks, n)`` of the widest integer type that tiles one block's
    bytes: a block is one row, and copying rows copies bytes (whatever the KV dtype, NaN patterns included)."""
    pieces = []
    for layer in views:
        for name in _REGIONS:
            region = getattr(layer, name)
            if region is None:
                continue
            rows = region.view(torch.uint8).reshape(region.shape[0], -1)
            width = next(w for w in (8, 4, 2, 1) if rows.shape[1] % w == 0)
            pieces.append(rows.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[width]))
    return pieces


def _runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first index, first slot, length) of each run of consecutive slots, in order."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            first, start, length = runs[-1]
            runs[-1] = (first, start, length + 1)
        else:
            runs.append((i, slot, 1))
    return runs


_DIRECT_MAX_RUNS = 2  # into no more runs of consecutive slots than this,
_DIRECT_MIN_BYTES = 8 << 20  # and this many bytes or more: each region's run copied straight into the tier


class BlockCopier:
    """Copies whole blocks between a device pool and a host tier's pool (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._last: torch.cuda.Event | None = None
        # staged stores still to be scattered into their slots: (copy landed, [(staged rows, tier rows, index)])
        self._pending: list[tuple[torch.cuda.Event | None, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]]
        self._pending = []
        self._scratch = torch.empty(0, dtype=torch.uint8)  # the CPU's gather buffer (_copy_on_cpu)
        self._pairs: dict[tuple[int, int], tuple[list[LayerKV], list[LayerKV], list]] = {}

    def _rows(self, pool: list[LayerKV], tier: list[LayerKV]) -> list[tuple[_RowGroup, _RowGroup]]:
        """``_row_groups(pool, tier)``, kept per pair of views lists (the engine passes the same two lists)."""
        kept = self._pairs.get((id(pool), id(tier)))
        if kept is None or kept[0] is not pool or kept[1] is not tier:
            kept = self._pairs[id(pool), id(tier)] = (pool, tier, _row_groups(pool, tier))
        return kept[2]

    def _direct(self, slots: Sequence[int], views: list[LayerKV], host: list[LayerKV]) -> list | None:
        """The runs of ``slots`` if the batch goes straight into them (a GPU, few runs, many bytes), else None."""
        runs = _runs(slots)
        pairs = self._rows(views, host)
        nbytes = len(slots) * sum(g.per_block * g.rows[0].nbytes * g.firsts.numel() for g, _ in pairs)
        return runs if self.cuda and len(runs) <= _DIRECT_MAX_RUNS and nbytes >= _DIRECT_MIN_BYTES else None

    def to_host(self, views: list[LayerKV], block_ids: Sequence[int], host: list[LayerKV],
                slots: Sequence[int]) -> None:  # fmt: skip
        """Copy blocks ``block_ids`` of the device pool into slots ``slots`` of the host tier."""
        if not block_ids:
            return
        if not self.cuda:
            for pool, tier in self._rows(views, host):
                self._copy_on_cpu(pool, block_ids, tier, slots)
            return
        runs = self._direct(slots, views, host)
        # a staged store still to land could be to a slot this copy writes now: it must not be scattered after it
        self._settle(wait=runs is not None)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the blocks' KV is written first
        with torch.cuda.stream(self.stream):
            if runs is None:
                self._staged_to_host(views, block_ids, host, slots)
            else:
                src = torch.tensor(block_ids, device=self.device)
                for source, target in zip(_pieces(views), _pieces(host), strict=True):
                    staged = source.index_select(0, src)
                    for first, slot, n in runs:
                        target[slot : slot + n].copy_(staged[first : first + n], non_blocking=True)
            self._record()

    def to_device(self, host: list[LayerKV], slots: Sequence[int], views: list[LayerKV],
                  block_ids: Sequence[int]) -> None:  # fmt: skip
        """Copy slots ``slots`` of the host tier into blocks ``block_ids`` of the device pool."""
        if not block_ids:
            return
        if not self.cuda:
            for pool, tier in self._rows(views, host):
                self._copy_on_cpu(tier, slots, pool, block_ids)
            return
        runs = self._direct(slots, views, host)
        self._settle(wait=True)  # the slots hold what was stored into them before anything reads them
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # nobody still reads the blocks
        with torch.cuda.stream(self.stream):
            if runs is None:
                self._staged_to_device(host, slots, views, block_ids)
            else:
                dst = torch.tensor(block_ids, device=self.device)
                for source, target in zip(_pieces(host), _pieces(views), strict=True):
                    staged = torch.empty((len(slots), source.shape[1]), dtype=source.dtype, device=self.device)
                    for first, slot, n in runs:
                        staged[first : first + n].copy_(source[slot : slot + n], non_blocking=True)
                    target.index_copy_(0, dst, staged)
            self._record()

    def _copy_on_cpu(self, source: _RowGroup, rows: Sequence[int], target: _RowGroup, into: Sequence[int]) -> None:
        """Blocks ``rows`` of ``source`` into ``into`` of ``target``: a gather into a scratch buffer kept for
        the next call (a new one of tens of MiB is a fresh mapping each time, whose page faults cost more
        than the copy), and a scatter."""
        index = source.index(torch.tensor(rows))
        nbytes = index.numel() * source.rows[0].nbytes
        if self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        staged = self._scratch[:nbytes].view(source.rows.dtype).view(index.numel(), -1)
        torch.index_select(source.rows, 0, index, out=staged)
        target.rows.index_copy_(0, target.index(torch.tensor(into)), staged)

    def _staged_to_host(self, views: list[LayerKV], block_ids: Sequence[int], host: list[LayerKV],
                        slots: Sequence[int]) -> None:  # fmt: skip
        """One gather of the blocks' rows per width on the device, one copy into pinned staging; the scatter
        into ``slots`` waits in ``_pending`` for the copy to land (at once on a CPU device, where tests run it)."""
        src, dst = torch.tensor(block_ids, device=self.device), torch.tensor(slots)
        scatters, landed = [], None
        for pool, tier in self._rows(views, host):
            rows = pool.rows.index_select(0, pool.index(src))
            if self.cuda:
                rows = _pinned_copy(rows)
            scatters.append((rows, tier.rows, tier.index(dst)))
        if self.cuda:
            landed = torch.cuda.Event()
            landed.record(self.stream)
        self._pending.append((landed, scatters))
        if not self.cuda:
            self._settle(wait=True)

    def _staged_to_device(self, host: list[LayerKV], slots: Sequence[int], views: list[LayerKV],
                          block_ids: Sequence[int]) -> None:  # fmt: skip
        """One gather of the slots' rows per width on the host (into pinned staging on a GPU), one copy to the
        device and one scatter there. The caller settled the staged stores first. (The caching host allocator
        keeps the staging buffer until its copy has run.)"""
        src, dst = torch.tensor(slots), torch.tensor(block_ids, device=self.device)
        for pool, tier in self._rows(views, host):
            index = tier.index(src)
            rows = torch.empty((index.numel(), tier.rows.shape[1]), dtype=tier.rows.dtype, pin_memory=self.cuda)
            torch.index_select(tier.rows, 0, index, out=rows)
            pool.rows.index_copy_(0, pool.index(dst), rows.to(self.device, non_blocking=self.cuda))

    def _settle(self, wait: bool) -> None:
        """Scatter staged stores into their slots, in the order they were issued: every one (waiting for
        its copy) when ``wait``, else those whose copy has landed, up to the first that has not."""
        while self._pending:
            landed, scatters = self._pending[0]
            if landed is not None:
                if wait:
                    landed.synchronize()
                elif not landed.query():
                    return
            for rows, target, index in scatters:
                target.index_copy_(0, index, rows)
            self._pending.pop(0)

    def _record(self) -> None:
        self._last = torch.cuda.Event()
        self._last.record(self.stream)

    def wait_for_copies(self) -> None:
        """Order the device's compute stream after every copy issued so far (no host wait)."""
        if self._last is not None:
            torch.cuda.current_stream(self.device).wait_event(self._last)

    def synchronize(self) -> None:
        """Wait, on the host, for every copy issued so far (before reading or writing slots on the host),
        and scatter the staged stores into their slots."""
        if self._last is not None:
            self._last.synchronize()
        self._settle(wait=True)


def _pinned_copy(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` copied into a new pinned host tensor, on the current stream (no host wait)."""
    staged = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    staged.copy_(rows, non_blocking=True)
    return staged
