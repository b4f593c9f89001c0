"""A step's model inputs: built with NumPy in one pinned host buffer, sent to the device in one copy.

Every input of a step (token ids, positions, pool slots, the rows whose logits are sampled, sequence
lengths, ``cu_seqlens_q``, block tables) is a typed section of one byte buffer; the host fills the sections
through NumPy views, one non-blocking ``copy_`` moves the used bytes, and the model reads typed views of the
device copy. Two kinds of step use two such buffers:

* ``stage_step`` (prefill, mixed, or decode when padding is off): the batch is packed tightly, its block
  tables as wide as its longest one; the buffer grows when a step needs more;
* ``PaddedDecodeInputs`` (decode-only batches): the batch is padded to a bucket size and laid out at the
  same addresses every step for that bucket, block tables at the maximum width, so that a CUDA graph
  captured over those addresses replays with whatever the host staged there. A padding row has slot -1
  (``store_kvcache`` skips it) and length 0 (decode attention returns zeros for it).

Sequences bring NumPy block tables (``BlockManager.block_table_array``), so a step costs a few NumPy calls
plus one small call per sequence; nothing is built token by token in Python.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

from engine.models.attention import AttentionMetadata, RingMetadata
from engine.sequence import Sequence
from kvstore import batch_slots
from kvstore.ring import FULL_RING_ROW, RING_SINKS, sink_query_positions

_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}
_ALIGN = 8  # every section starts 8-byte aligned, so an int64 view of the device bytes is legal

Section = tuple[str, type, tuple[int, ...]]  # (name, NumPy dtype, shape)


class StagingBuffer:
    """A pinned host byte buffer and its device twin (both plain memory on the CPU)."""

    def __init__(self, nbytes: int, device: torch.device, *, growable: bool = True) -> None:
        self.device = device
        self.growable = growable
        # Marks the last send: the host bytes must not be rewritten before that copy has read them.
        self._sent = torch.cuda.Event() if device.type == "cuda" else None
        self._allocate(nbytes)

    def _allocate(self, nbytes: int) -> None:
        # Pinned memory lets the copy run asynchronously; a buffer dropped while a copy from it is in flight
        # stays alive in torch's caching host allocator until that copy is done.
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        self.device_bytes = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._host_np = self.host.numpy()

    @property
    def nbytes(self) -> int:
        return self.host.shape[0]

    @staticmethod
    def size_of(sections: Seq[Section]) -> int:
        end = 0
        for _, dtype, shape in sections:
            end = -(-end // _ALIGN) * _ALIGN + int(np.prod(shape)) * np.dtype(dtype).itemsize
        return end

    def views(self, sections: Seq[Section]) -> tuple[dict[str, np.ndarray], dict[str, torch.Tensor], int]:
        """Lay ``sections`` out from offset 0: (host NumPy views, device tensor views, bytes used).

        Grows the buffer when they do not fit (a fixed-address buffer raises instead); views taken before a
        growth point at the old memory."""
        self.wait_sent()
        end = self.size_of(sections)
        if end > self.nbytes:
            if not self.growable:
                raise ValueError(f"{end} bytes of inputs do not fit a fixed staging buffer of {self.nbytes}")
            self._allocate(max(end, 2 * self.nbytes))
        host, device, offset = {}, {}, 0
        for name, dtype, shape in sections:
            dtype = np.dtype(dtype)
            offset = -(-offset // _ALIGN) * _ALIGN
            size = int(np.prod(shape)) * dtype.itemsize
            host[name] = self._host_np[offset : offset + size].view(dtype).reshape(shape)
            device[name] = self.device_bytes[offset : offset + size].view(_TORCH_DTYPES[dtype]).view(shape)
            offset += size
        return host, device, end

    def send(self, nbytes: int) -> None:
        """Copy the first ``nbytes`` to the device: one transfer, asynchronous from pinned memory."""
        self.device_bytes[:nbytes].copy_(self.host[:nbytes], non_blocking=True)
        if self._sent is not None:
            self._sent.record()

    def wait_sent(self) -> None:
        """Block until the last send has read the host bytes (at once unless the step sampled nothing)."""
        if self._sent is not None:
            self._sent.synchronize()


@dataclass
class StepInputs:
    """Device tensors of one step. ``logit_rows``: the rows whose logits are sampled, in batch order: the last
    token of every sequence that samples this step, and for a speculating one (``engine.speculative``) the
    row of its last real token and of each proposal (``logit_counts``: how many rows each sampled sequence
    has); ``sampled``: those sequences' batch indices."""

    input_ids: torch.Tensor  # (tokens,) int64
    positions: torch.Tensor  # (tokens,) int64
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # (rows,) int64
    sampled: list[int]
    logit_counts: list[int]


def stage_step(
    buffer: StagingBuffer, seqs: list[Sequence], num_new_tokens: list[int], num_decodes: int, block_size: int
) -> StepInputs:
    """Pack a batch (decodes first, then prefill chunks; see ``AttentionMetadata``) and send it."""
    num_seqs = len(seqs)
    counts = np.asarray(num_new_tokens, dtype=np.int64)
    starts = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, num_seqs)
    ends = starts + counts
    num_proposed = np.fromiter((len(s.spec_token_ids) for s in seqs), np.int64, num_seqs)
    totals = np.fromiter((s.num_tokens for s in seqs), np.int64, num_seqs) + num_proposed
    sampled = np.flatnonzero(ends == totals)
    logit_counts = 1 + num_proposed[sampled]
    num_tokens = int(counts.sum())
    width = max(len(s.block_table) for s in seqs)
    rings = _ring_rows(seqs)
    host, dev, nbytes = buffer.views([
        ("input_ids", np.int64, (num_tokens,)),
        ("positions", np.int64, (num_tokens,)),
        ("slot_mapping", np.int64, (num_tokens,)),
        ("logit_rows", np.int64, (int(logit_counts.sum()),)),
        ("seq_lens", np.int32, (num_seqs,)),
        ("cu_seqlens_q", np.int32, (num_seqs + 1,)),
        ("block_tables", np.int32, (num_seqs, width)),
        *([] if rings is None else [("ring", np.int32, (num_seqs, 4)), ("sink_positions", np.int64, (num_tokens,))]),
    ])  # fmt: skip
    cu = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(counts, out=cu[1:])
    host["cu_seqlens_q"][:] = cu
    host["seq_lens"][:] = ends
    tables = host["block_tables"]
    _write_tokens_and_tables(host["input_ids"], tables, seqs, num_decodes, cu, starts, ends)
    rows = np.repeat(np.arange(num_seqs), counts)
    positions = np.arange(num_tokens) + (starts - cu[:-1])[rows]
    host["positions"][:] = positions
    host["slot_mapping"][:] = batch_slots(tables, rows, positions, block_size, None if rings is None else rings[rows])
    # each sampled sequence's last logit_counts rows
    host["logit_rows"][:] = np.repeat(cu[1:][sampled] - logit_counts, logit_counts) + _ranks(logit_counts)
    ring = None
    if rings is not None:
        host["ring"][:] = rings
        host["sink_positions"][:] = sink_query_positions(positions, rings[rows])
        ring = RingMetadata(dev["ring"], dev["sink_positions"], int(positions.max()), bool(rings[:, RING_SINKS].any()))
    buffer.send(nbytes)
    meta = AttentionMetadata(
        slot_mapping=dev["slot_mapping"],
        block_tables=dev["block_tables"],
        seq_lens=dev["seq_lens"],
        cu_seqlens_q=dev["cu_seqlens_q"],
        num_decodes=num_decodes,
        max_q_len=int(counts.max()),
        ring=ring,
    )
    return StepInputs(dev["input_ids"], dev["positions"], meta, dev["logit_rows"], sampled.tolist(),
                      logit_counts.tolist())  # fmt: skip


def _ring_rows(seqs: list[Sequence]) -> np.ndarray | None:
    """(seqs, 4) kernel rows when some sequence attends over a window (``kvstore.ring``), else None."""
    if all(s.ring is None for s in seqs):
        return None
    return np.array([FULL_RING_ROW if s.ring is None else s.ring.kernel_row() for s in seqs], dtype=np.int64)


def _write_tokens_and_tables(ids: np.ndarray, tables: np.ndarray, seqs: list[Sequence], num_decodes: int,
                             cu: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:  # fmt: skip
    """Each sequence's new token ids (a decode's one token; a chunk's tokens, or a speculating sequence's last
    token and its proposals) at ``ids[cu[i]:cu[i+1]]``, and its block table in row ``i`` of ``tables``."""
    # entries past a sequence's last block are never read, so rows are not cleared
    ids[:num_decodes] = [s.token_ids[s.num_computed_tokens] for s in seqs[:num_decodes]]
    for i, seq in enumerate(seqs):
        tables[i, : len(seq.block_table)] = seq.block_table
        if i >= num_decodes:
            if seq.spec_token_ids:  # its last token, then its proposals
                ids[cu[i] : cu[i + 1]] = [*seq.token_ids[starts[i] :], *seq.spec_token_ids]
            else:
                ids[cu[i] : cu[i + 1]] = seq.token_ids[starts[i] : ends[i]]


def _ranks(counts: np.ndarray) -> np.ndarray:
    """0, 1, .., counts[0] - 1, 0, 1, .., counts[1] - 1, ...: each element's rank within its group."""
    starts = np.cumsum(counts) - counts
    return np.arange(int(counts.sum())) - np.repeat(starts, counts)


class PaddedDecodeInputs:
    """Fixed-address inputs of decode-only steps padded to ``buckets`` sizes.

    Bucket ``b``'s layout (``b`` tokens = ``b`` sequences, block tables ``(b, max_blocks_per_seq)``) starts
    at offset 0 of one shared buffer; its device views and ``AttentionMetadata`` are built once, so a step
    only writes NumPy views and sends. ``max_blocks_per_seq`` is fixed so that the decode kernel, which
    sizes its split heuristic from ``block_tables.shape[1]``, launches the same grid every step.
    """

    def __init__(self, buckets: list[int], max_blocks_per_seq: int, device: torch.device) -> None:
        self.buckets = sorted(buckets)
        self.max_blocks_per_seq = max_blocks_per_seq
        size = max(StagingBuffer.size_of(self._sections(b)) for b in self.buckets)
        self.buffer = StagingBuffer(size, device, growable=False)
        self._layouts = {b: self.buffer.views(self._sections(b)) for b in self.buckets}
        self.metas = {
            b: AttentionMetadata(
                slot_mapping=dev["slot_mapping"],
                block_tables=dev["block_tables"],
                seq_lens=dev["seq_lens"],
                cu_seqlens_q=dev["cu_seqlens_q"],
                num_decodes=b,
                max_q_len=1,
            )
            for b, (_, dev, _) in self._layouts.items()
        }
        self._arange = np.arange(self.buckets[-1] + 1)

    def _sections(self, bucket: int) -> list[Section]:
        return [
            ("input_ids", np.int64, (bucket,)),
            ("positions", np.int64, (bucket,)),
            ("slot_mapping", np.int64, (bucket,)),
            ("seq_lens", np.int32, (bucket,)),
            ("cu_seqlens_q", np.int32, (bucket + 1,)),
            ("block_tables", np.int32, (bucket, self.max_blocks_per_seq)),
        ]

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket that holds ``num_seqs`` sequences; None past the largest."""
        index = int(np.searchsorted(self.buckets, num_seqs))
        return self.buckets[index] if index < len(self.buckets) else None

    def device_inputs(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids, positions, metadata) of ``bucket``: the same tensors every step."""
        _, dev, _ = self._layouts[bucket]
        return dev["input_ids"], dev["positions"], self.metas[bucket]

    def stage(self, bucket: int, seqs: list[Sequence], block_size: int) -> bool:
        """Write a decode-only batch (each sequence brings its token ``num_computed_tokens``) padded to
        ``bucket`` rows, and send it. False, with nothing sent, when a block table is too wide."""
        host, _, nbytes = self._layouts[bucket]
        self.buffer.wait_sent()
        n, tables = len(seqs), host["block_tables"]
        blocks = [s.block_table for s in seqs]
        widths = np.fromiter(map(len, blocks), np.int64, n)
        width = int(widths.max())
        if width > self.max_blocks_per_seq:
            return False
        # every table in one masked write (row-major, so in batch order), not a slice assignment per sequence
        tables[:n, :width][np.arange(width) < widths[:, None]] = np.concatenate(blocks)
        positions = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, n)
        host["input_ids"][:n] = [s.token_ids[s.num_computed_tokens] for s in seqs]
        host["positions"][:n] = positions
        host["slot_mapping"][:n] = batch_slots(tables, self._arange[:n], positions, block_size)
        host["seq_lens"][:n] = positions + 1
        self._pad(host, n, bucket)
        self.buffer.send(nbytes)
        return True

    def host_arrays(self, bucket: int) -> dict[str, np.ndarray]:
        """Copies of what ``stage`` last wrote for ``bucket``: another rank stages them (``stage_arrays``)."""
        host, _, _ = self._layouts[bucket]
        return {name: array.copy() for name, array in host.items()}

    def stage_arrays(self, bucket: int, arrays: dict[str, np.ndarray]) -> None:
        """Write ``bucket`` as another rank's ``host_arrays`` give it, and send it."""
        host, _, nbytes = self._layouts[bucket]
        self.buffer.wait_sent()
        for name, array in host.items():
            array[...] = arrays[name]
        self.buffer.send(nbytes)

    def stage_padding(self, bucket: int) -> None:
        """Fill ``bucket`` with padding rows only (for warm-up and capture) and send it."""
        host, _, nbytes = self._layouts[bucket]
        self.buffer.wait_sent()
        host["block_tables"].fill(0)
        self._pad(host, 0, bucket)
        self.buffer.send(nbytes)

    def _pad(self, host: dict[str, np.ndarray], n: int, bucket: int) -> None:
        host["input_ids"][n:] = 0
        host["positions"][n:] = 0
        host["slot_mapping"][n:] = -1
        host["seq_lens"][n:] = 0
        host["cu_seqlens_q"][:] = self._arange[: bucket + 1]
