"""The ``nixl`` transport (another host, or forced: any host; DRAM or VRAM): one NIXL WRITE per hand-off.

Push, not pull. The prefill worker writes the finished blocks from its own pool into the decode worker's
leased blocks, as ``shm`` and ``cuda_ipc`` do, so the lease keeps one meaning whatever the transport: the
decode worker grants a writer some blocks until a deadline, and the writer ends the lease once it will never
write again (``Backend.writes_in_place``). The KV moves once, while the prefill worker still holds its
blocks (``take``, before the engine releases them), with no staging copy and no extra round trip; pulling
(vLLM's model) would make the prefill worker keep its blocks until a decode worker comes to read them, and
add a second lease in the other direction.

* The decode worker registers its whole pool (``KVCache.buffer``; split over tensor-parallel ranks, every
  rank's part, with ``KVDestination.kv_heads``) with one agent at start-up (``NixlPool``)
  and offers the agent's metadata and the pool's address only inside the signed lease
  (``KVDestination.nixl_metadata``, ``nixl_pool``), over authenticated gRPC. No NIXL metadata listener runs.
* The prefill worker's agent (one per worker, ``local_agent``) registers its own pool on first use, loads a
  decode worker's metadata once per pool (``NixlTransport.open``), and writes each hand-off's blocks with a
  notification naming the request. ``take`` waits for the write to complete (or fails it at the lease's write
  deadline), so the lease ends after the last byte, and returns the checksum of the source blocks.
* The decode worker trusts that checksum only once the notification from that writer has arrived
  (``NixlPool.arrived``; ``decode_service.remote_prefill``), then verifies its own copy against it.

NIXL/UCX authenticates nothing on the data path: this is for a trusted cluster fabric (README, trust model).
Without NIXL installed the module still imports (``transfer.backend.nixl_installed()`` is False), and ``open``
refuses.

The agents and the decode worker's registered pool: ``transfer.nixl_agent``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass

import numpy as np

from kvstore.kv_cache import KVCache, KVCacheSpec
from kvstore.split_pool import SplitPool, parse_layout
from protos.kvserve.v1 import kvserve_pb2 as pb
from transfer.backend import Backend
from transfer.blocks import checksum_blocks
from transfer.interface import KVTransport, Origin, TransferFailed
from transfer.nixl_agent import LocalAgent, local_agent, memory_of, writer_of

WRITE_TIMEOUT_S = 30.0  # a write's limit when the caller names no deadline
_POLL_S = 0.0002


def region_layout(spec: KVCacheSpec, num_blocks: int) -> list[tuple[int, int]]:
    """(offset in the pool buffer, bytes per block) of every layer's K, V (and scale) region, in the order of
    ``transfer.blocks`` (``KVCache._carve``): regions are padded at their ends, never between blocks."""
    elems = spec.block_size * spec.num_kv_heads
    per_block = {"k": elems * spec.head_dim * spec.k_dtype.itemsize, "v": elems * spec.head_dim * spec.v_dtype.itemsize,
                 "k_scale": elems * 4, "v_scale": elems * 4}  # fmt: skip
    layout, offset = [], 0
    for _ in range(spec.num_layers):
        for name, nbytes in spec.region_bytes(num_blocks):
            layout.append((offset, per_block[name]))
            offset += nbytes
    return layout


@dataclass(frozen=True)
class _Part:
    """One part of a pool (``kvstore.split_pool``) as a NIXL write addresses it: where its buffer lies, its
    layout, its first KV head."""

    base: int
    device: int
    spec: KVCacheSpec
    num_blocks: int
    first: int

    @property
    def heads(self) -> int:
        return self.spec.num_kv_heads


def _parts_of(pool: SplitPool) -> list[_Part]:
    return [_Part(p.buffer.data_ptr(), memory_of(p.buffer)[1], p.spec, p.num_blocks, first)
            for p, first in zip(pool.parts, pool.firsts, strict=True)]  # fmt: skip


def _rows(addresses: np.ndarray, lengths: np.ndarray, device: int) -> np.ndarray:
    return np.stack([addresses, lengths, np.full_like(addresses, device)], axis=1)


def _descs(src: list[_Part], src_blocks: list[int], dst: list[_Part], dst_blocks: list[int]) -> tuple[np.ndarray,
                                                                                                        np.ndarray]:
    """(address, length, device) rows of the source and of the destination, pairwise of equal length, that
    write ``src_blocks`` into ``dst_blocks`` (one to one), every region, each destination part's heads from the
    source parts that hold them. Parts that hold the same heads move runs of whole blocks (a row per run and
    region); parts split otherwise move each token's row of the heads they share (a region's block is
    ``block_size`` rows of all the part's heads: ``kvstore.kv_cache``)."""
    src_starts, dst_starts, runs = _runs(src_blocks, dst_blocks)
    src_ids, dst_ids = np.asarray(src_blocks, dtype=np.int64)[:, None], np.asarray(dst_blocks, dtype=np.int64)[:, None]
    tokens = np.arange(src[0].spec.block_size, dtype=np.int64)
    src_rows, dst_rows = [], []
    for s in src:
        for d in dst:
            lo, hi = max(s.first, d.first), min(s.first + s.heads, d.first + d.heads)
            if lo >= hi:
                continue
            same = s.first == d.first and s.heads == d.heads
            regions = zip(region_layout(s.spec, s.num_blocks), region_layout(d.spec, d.num_blocks), strict=True)
            for (s_off, s_stride), (d_off, d_stride) in regions:
                if same:
                    src_rows.append(_rows(s.base + s_off + src_starts * s_stride, runs * s_stride, s.device))
                    dst_rows.append(_rows(d.base + d_off + dst_starts * d_stride, runs * d_stride, d.device))
                    continue
                head = s_stride // (len(tokens) * s.heads)  # bytes of one head in a token's row of this region
                at_src = s.base + s_off + src_ids * s_stride + tokens * s.heads * head + (lo - s.first) * head
                at_dst = d.base + d_off + dst_ids * d_stride + tokens * d.heads * head + (lo - d.first) * head
                length = np.full(at_src.size, (hi - lo) * head, dtype=np.int64)
                src_rows.append(_rows(at_src.ravel(), length, s.device))
                dst_rows.append(_rows(at_dst.ravel(), length, d.device))
    return np.concatenate(src_rows).astype(np.uint64), np.concatenate(dst_rows).astype(np.uint64)


def _runs(src: list[int], dst: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pairs of consecutive block runs: (source starts, destination starts, lengths). One descriptor per run
    and region instead of one per block."""
    s, d = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    first = np.concatenate([[0], breaks])
    lengths = np.diff(np.concatenate([first, [len(s)]]))
    return s[first], d[first], lengths


@dataclass(frozen=True)
class Written:
    """What ``take`` did: the checksum of the source blocks once written, or why the write failed."""

    checksum: str = ""
    error: str = ""


class NixlTransport(KVTransport):
    """One decode worker's registered pool, as this prefill worker's agent reaches it. Closing it unloads
    that agent's metadata (and disconnects from it)."""

    backend = Backend.NIXL

    def __init__(self, worker_id: str, local: LocalAgent, remote: str, mem: str, parts: list[_Part]) -> None:
        super().__init__(worker_id)
        self.local, self.remote = local, remote
        self.mem, self.parts = mem, parts  # the destination pool's parts (one, or one per tensor-parallel rank)

    @staticmethod
    def key(dest: pb.KVDestination) -> str:
        digest = hashlib.sha256(dest.nixl_metadata + dest.nixl_pool.encode()).hexdigest()[:16]
        return f"nixl:{dest.worker_id}:{digest}"

    @classmethod
    def open(cls, dest: pb.KVDestination, origin: Origin) -> NixlTransport:
        pools = [p.split(":") for p in dest.nixl_pool.split(";")]
        mems = {p[0] for p in pools}
        if not dest.nixl_metadata or any(len(p) != 3 for p in pools) or len(mems) != 1 or not mems <= {"DRAM", "VRAM"}:
            raise ValueError("the destination offers no NIXL agent and pool")
        heads = parse_layout(dest.kv_heads, origin.spec.num_kv_heads, len(pools))
        parts = [_Part(int(address), int(device), dataclasses.replace(origin.spec, num_kv_heads=n), dest.num_blocks,
                       sum(heads[:i])) for i, ((_, device, address), n) in enumerate(zip(pools, heads, strict=True))]
        local = local_agent(origin.worker_id)
        remote = local.agent.add_remote_agent(dest.nixl_metadata)
        remote = remote.decode() if isinstance(remote, bytes) else remote
        if writer_of(remote) != dest.worker_id:
            local.agent.remove_remote_agent(remote)
            raise ValueError(f"the NIXL agent {remote!r} is not decode worker {dest.worker_id!r}'s")
        return cls(dest.worker_id, local, remote, mems.pop(), parts)

    def take(self, source: SplitPool | KVCache, block_ids: list[int], request_id: str = "", dst_blocks: list[int] = (),
             deadline: float | None = None) -> Written:  # fmt: skip
        """Write ``block_ids`` of ``source`` into ``dst_blocks`` (one to one), with a notification naming
        ``request_id``, and wait for it; at ``deadline`` (monotonic) an unfinished write is cancelled. Never
        raises: a failure is reported by ``finish``, and returns only once no byte of it can still land."""
        if len(block_ids) != len(dst_blocks):
            return Written(error=f"{len(block_ids)} source blocks for {len(dst_blocks)} leased ones")
        if not block_ids:
            return Written(checksum="")
        source = SplitPool.of(source)
        deadline = min(deadline if deadline is not None else float("inf"), time.monotonic() + WRITE_TIMEOUT_S)
        try:
            for part in source.parts:
                self.local.register(part)
            agent = self.local.agent
            src_rows, dst_rows = _descs(_parts_of(source), block_ids, self.parts, dst_blocks)
            local = agent.get_xfer_descs(src_rows, memory_of(source.parts[0].buffer)[0])
            remote = agent.get_xfer_descs(dst_rows, self.mem)
            handle = agent.initialize_xfer("WRITE", local, remote, self.remote, request_id.encode())
        except Exception as err:  # noqa: BLE001 - nixl raises its own types; nothing was posted
            return Written(error=f"preparing the NIXL write failed: {err}")
        state = agent.transfer(handle)
        digest = checksum_blocks(source, block_ids) if state != "ERR" else ""  # while the write runs
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            return Written(error=self._abandon(handle, state))
        agent.release_xfer_handle(handle)
        return Written(digest)

    def _abandon(self, handle, state: str) -> str:  # noqa: ANN001 - nixl_xfer_handle
        """Release a failed or overdue write; one that cannot be cancelled is waited for, so that no byte of it
        lands once the lease ends."""
        while True:
            try:
                self.local.agent.release_xfer_handle(handle)
                break
            except Exception:  # noqa: BLE001 - still in flight and not cancellable: wait for it
                time.sleep(0.01)
        return "the NIXL write failed" if state == "ERR" else "the NIXL write did not finish before the deadline"

    async def finish(self, request_id: str, dst_blocks: list[int], taken: Written) -> str:
        if taken.error:
            raise TransferFailed(taken.error)
        return taken.checksum

    def close(self) -> None:
        self.local.agent.remove_remote_agent(self.remote)
