"""L3: KV blocks in files on a local disk, below the host tier, checksum-verified on load and kept across restarts.

A block's life here: the host tier evicts it and calls ``store``, which copies the block's bytes out of the
host pool at once (the caller may reuse the slot when it returns) and queues the file write to the one writer
thread. From then on the block is held: ``lookup`` finds it and ``load`` serves it, from the queued bytes until
the file is written and from the file after. A ``load`` that finds the file corrupt, truncated or naming other
tokens deletes it and reports a miss, so the engine recomputes the block. A restarted worker rescans the
directory and re-announces what it finds (``hashes``, ``take_events``).

The files' format is ``kvstore.disk_format``'s: written to a temp file beside its name and renamed over it,
so a crash leaves a whole file or a temp file that the next start deletes; no fsync (see there).

Once the start-up scan is done, only the writer thread changes files (writes, deletes, mtime touches), in the
order they were queued, so a delete queued by an eviction can never remove a newer write of the same block.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstore import disk_format
from kvstore.kv_cache import KVCache, KVCacheSpec
from kvstore.split_pool import SplitPool, copy_blocks

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Entry:
    """A held block: what ``lookup`` compares, its file's size, and its bytes while their write is queued."""

    parent_hash: str
    token_ids: tuple[int, ...]
    nbytes: int
    payload: bytearray | None = None


class DiskTier:
    """A size-bounded directory of KV blocks of one layout, with its own LRU.

    Invariants (under ``_lock``):
    * ``_index`` holds every held block, least recently used first; ``store`` and a successful ``load`` move a
      block to the back, and eviction takes from the front until ``used_bytes`` <= ``capacity_bytes``;
    * ``used_bytes`` is the sum of the held blocks' file sizes (written or not yet);
    * an entry's ``payload`` is set iff its write is queued or in flight; ``load`` serves it from there;
    * a held block is never served unless its tokens and parent hash match the caller's and, when read from
      disk, the file's header and disk_format.checksum match too; a file that fails is deleted and its block dropped.

    ``take_events`` gives the net change of the held set like ``BlockPool.take_events``; the blocks found at
    start-up count as stored in the first take.
    """

    def __init__(self, directory: str | os.PathLike, fingerprint: str, capacity_bytes: int, spec: KVCacheSpec,
                 max_pending_bytes: int = 256 << 20) -> None:  # fmt: skip
        """``max_pending_bytes`` bounds the bytes waiting for the writer: past it ``store`` drops blocks
        instead of buffering without limit when the disk is slower than the host tier's evictions."""
        if not disk_format.FINGERPRINT_NAME.fullmatch(fingerprint):
            raise ValueError(f"layout fingerprint {fingerprint!r} cannot name a directory")
        self.root = Path(directory) / fingerprint
        self.fingerprint = fingerprint
        self.spec = spec
        self.capacity_bytes = capacity_bytes
        self.max_pending_bytes = max_pending_bytes
        self.payload_bytes = spec.bytes_per_block()
        self.bytes_per_file = disk_format.bytes_per_file(fingerprint, spec)
        if capacity_bytes < self.bytes_per_file:
            raise ValueError(f"disk KV cache capacity {capacity_bytes} B is less than one block of this layout "
                             f"({self.bytes_per_file} B): raise disk_kv_cache_gb or turn the tier off")  # fmt: skip
        disk_format.check_writable(self.root)

        self._lock = threading.Lock()
        self._index: OrderedDict[str, _Entry] = OrderedDict()
        self._used = 0
        self._pending_bytes = 0
        self._events: dict[str, bool] = {}  # hash -> held now; only hashes that changed since the last take
        self._ops: queue.Queue[tuple[str, str, _Entry | None] | None] = queue.Queue()
        self._closed = False
        self._rescan()
        free = shutil.disk_usage(self.root).free
        if capacity_bytes > free + self._used:
            raise ValueError(f"disk KV cache capacity {capacity_bytes} B is more than the filesystem of {self.root} "
                             f"can give it ({free} B free + {self._used} B of blocks already there): lower "
                             f"disk_kv_cache_gb or free space")  # fmt: skip
        with self._lock:
            self._trim()
        self._writer = threading.Thread(target=self._write_loop, name=f"disk-kv-{fingerprint}", daemon=True)
        self._writer.start()

    # -- the caller's side ---------------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._index)

    def contains(self, block_hash: str) -> bool:
        return block_hash in self._index

    def lookup(self, block_hash: str, token_ids: Sequence[int], parent_hash: str) -> bool:
        """Whether this block of tokens after this parent is held (the index only: no disk read, no LRU touch)."""
        entry = self._index.get(block_hash)
        return entry is not None and entry.token_ids == tuple(token_ids) and entry.parent_hash == parent_hash

    def hashes(self) -> list[str]:
        """Every held block's hash, least recently used first."""
        with self._lock:
            return list(self._index)

    def store(self, block_hash: str, parent_hash: str, token_ids: Sequence[int], pool: SplitPool | KVCache,
              block_id: int) -> bool:  # fmt: skip
        """Hold block ``block_id`` of ``pool`` (every part's heads: a file holds whole heads, whatever the
        tensor-parallel split that wrote it) under ``block_hash``. Its bytes are copied before this
        returns; the file is written in the background. A block already held is only touched, not rewritten.
        False when the block was dropped because ``max_pending_bytes`` are already waiting for the disk."""
        if not disk_format.BLOCK_NAME.fullmatch(block_hash):
            raise ValueError(f"block hash {block_hash!r} is not a hex hash")
        with self._lock:
            if self._closed:
                raise RuntimeError("store on a closed DiskTier")
            if self._touch(block_hash):
                return True
            if self._pending_bytes and self._pending_bytes + self.payload_bytes > self.max_pending_bytes:
                log.debug("disk KV writes are %d B behind: block %s not stored", self._pending_bytes, block_hash)
                return False
        payload = bytearray(self.payload_bytes)
        copy_blocks(SplitPool.of(pool), [block_id], self._one_block(payload), [0])
        token_ids = tuple(token_ids)
        entry = _Entry(parent_hash, token_ids, disk_format.header_bytes(self.fingerprint, block_hash, parent_hash,
                                                             len(token_ids)) + len(payload), payload)  # fmt: skip
        with self._lock:
            if self._touch(block_hash):  # another thread stored it meanwhile
                return True
            self._index[block_hash] = entry
            self._used += entry.nbytes
            self._pending_bytes += len(payload)
            self._note(block_hash, held=True)
            self._ops.put(("write", block_hash, entry))
            self._trim()
        return True

    def load(self, block_hash: str, token_ids: Sequence[int], parent_hash: str, pool: SplitPool | KVCache,
             block_id: int) -> bool:  # fmt: skip
        """Write the held block into block ``block_id`` of ``pool`` (each part its heads); True when it did. False for a
        block not held under these tokens and parent, and for a file that fails any check (it is deleted)."""
        token_ids = tuple(token_ids)
        with self._lock:
            entry = self._index.get(block_hash)
            if entry is None or entry.token_ids != token_ids or entry.parent_hash != parent_hash:
                return False
            self._index.move_to_end(block_hash)
            payload = entry.payload
        if payload is None:
            path = self._path(block_hash)
            try:
                payload = self._read(path, block_hash, token_ids, parent_hash)
            except (OSError, ValueError) as e:
                log.warning("disk KV block %s is unusable (%s): deleting it, the block will be recomputed", path, e)
                with self._lock:
                    if self._index.get(block_hash) is entry:
                        self._evict(block_hash)
                return False
            self._ops.put(("touch", block_hash, None))  # the mtime is the LRU order the next start rebuilds
        copy_blocks(self._one_block(payload), [0], SplitPool.of(pool), [block_id])
        return True

    def take_events(self) -> tuple[list[str], list[str]]:
        """(hashes stored, hashes evicted) since the last call, netted like ``BlockPool.take_events``."""
        with self._lock:
            stored = [h for h, held in self._events.items() if held]
            evicted = [h for h, held in self._events.items() if not held]
            self._events.clear()
        return stored, evicted

    def flush(self) -> None:
        """Wait until every queued write and delete is on disk."""
        self._ops.join()

    def close(self) -> None:
        """Finish the queued writes and stop the writer thread; the files stay for the next start."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._ops.put(None)
        self._writer.join()

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the index (under _lock) ------------------------------------------------------------------------------

    def _touch(self, block_hash: str) -> bool:
        if block_hash not in self._index:
            return False
        self._index.move_to_end(block_hash)
        self._ops.put(("touch", block_hash, None))
        return True

    def _trim(self) -> None:
        while self._used > self.capacity_bytes and len(self._index) > 1:
            self._evict(next(iter(self._index)))

    def _evict(self, block_hash: str) -> None:
        entry = self._index.pop(block_hash)
        self._used -= entry.nbytes
        if entry.payload is not None:  # its write is skipped, or finishes before the delete below
            self._pending_bytes -= len(entry.payload)
            entry.payload = None
        self._note(block_hash, held=False)
        self._ops.put(("delete", block_hash, None))

    def _note(self, block_hash: str, held: bool) -> None:
        if self._events.get(block_hash) is (not held):
            del self._events[block_hash]  # back to what it was at the last take
        else:
            self._events[block_hash] = held

    # -- files ----------------------------------------------------------------------------------------------

    def _path(self, block_hash: str) -> Path:
        return self.root / block_hash[:2] / block_hash

    def _one_block(self, payload: bytearray) -> SplitPool:
        return SplitPool([KVCache(self.spec, 1, "cpu", buffer=torch.frombuffer(payload, dtype=torch.uint8))])

    def _read(self, path: Path, block_hash: str, token_ids: tuple[int, ...], parent_hash: str) -> bytearray:
        with open(path, "rb") as f:
            header = disk_format.BlockHeader.read(f)
            self._check(header, block_hash)
            if header.token_ids != token_ids or header.parent_hash != parent_hash:
                raise ValueError("its header names other tokens or another parent than the index")
            return disk_format.read_payload(f, header)

    def _check(self, header: disk_format.BlockHeader, block_hash: str) -> None:
        if header.fingerprint != self.fingerprint:
            raise ValueError(f"written for layout {header.fingerprint!r}")
        if header.block_hash != block_hash:
            raise ValueError(f"its header names block {header.block_hash}")
        if header.payload_bytes != self.payload_bytes:
            raise ValueError(f"payload of {header.payload_bytes} B, this layout's blocks are {self.payload_bytes} B")

    def _rescan(self) -> None:
        """Index the blocks a previous run left (headers only, least recently touched first); delete temp files
        and files whose header or length is wrong."""
        for header, size in disk_format.scan(self.root, self._check):
            entry = _Entry(header.parent_hash, header.token_ids, size)
            self._index[header.block_hash] = entry
            self._used += entry.nbytes
            self._note(header.block_hash, held=True)

    def _write_loop(self) -> None:
        while (op := self._ops.get()) is not None:
            kind, block_hash, entry = op
            try:
                if kind == "write":
                    self._write(block_hash, entry)
                elif kind == "delete":
                    self._path(block_hash).unlink(missing_ok=True)
                elif self._path(block_hash).exists():
                    os.utime(self._path(block_hash))
            except OSError as e:
                log.warning("disk KV cache: %s of block %s failed: %s", kind, block_hash, e)
            finally:
                self._ops.task_done()
        self._ops.task_done()

    def _write(self, block_hash: str, entry: _Entry) -> None:
        with self._lock:
            payload = entry.payload if self._index.get(block_hash) is entry else None
        if payload is None:
            return  # evicted before its turn
        header = disk_format.BlockHeader(self.fingerprint, block_hash, entry.parent_hash, entry.token_ids, len(payload),
                             disk_format.checksum(payload))  # fmt: skip
        try:
            disk_format.write_block_file(self._path(block_hash), header, payload)
        except OSError as e:
            log.warning("disk KV cache: could not write block %s (%s): dropped", block_hash, e)
            with self._lock:
                if self._index.get(block_hash) is entry:
                    self._evict(block_hash)
            return
        with self._lock:
            if entry.payload is not None:  # not evicted meanwhile (then _evict settled the accounting)
                self._pending_bytes -= len(entry.payload)
                entry.payload = None
