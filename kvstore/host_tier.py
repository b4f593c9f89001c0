"""The host tier (L2) below the device pool.

``HostTier`` is a second pool of the device pool's layout (a ``KVCache`` in host memory, pinned when the
device pool is on a GPU) whose blocks, *slots*, it gives out for one of two uses:

* a cached block the device pool evicted (``add``): findable by its chained hash, token ids and parent
  hash, kept in the tier's own LRU, evicted from the front when a slot is needed (handed to ``on_evict``
  first, for a tier below to keep); a *pinned* entry (a load of it is planned) is never evicted;
* the blocks of a sequence swapped out by preemption (``take_slots``): held until the sequence is loaded
  back or ends (``free_slots``), never evicted.

Moving blocks between the device pool and a tier is ``kvstore.block_copier``'s.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvstore.kv_cache import KVCache, KVCacheSpec

log = logging.getLogger(__name__)

# The host tier when host_kv_cache_gb is unset: twice the KV pool (SGLang HiCache's default ratio), at most
# 4 GiB (vLLM's default swap space per GPU) and a quarter of the memory the host has available at start,
# so that a machine of several workers keeps most of its memory.
AUTO_HOST_RATIO = 2
AUTO_HOST_MAX_BYTES = 4 << 30
AUTO_HOST_AVAILABLE_SHARE = 0.25


@dataclass(eq=False)
class TierEntry:
    """A cached block held in a tier slot: what it holds (its chained hash, tokens and parent's hash), where."""

    block_hash: str
    parent_hash: str
    token_ids: tuple[int, ...]
    slot: int
    pins: int = 0


class HostTier:
    """L2: host slots for cached blocks (an LRU) and for swapped-out sequences (see the module docstring).

    Invariants: every slot is in exactly one of the free list, one entry, or one swap holding; an entry with
    ``pins`` > 0 is never evicted; ``take_events`` reports the net change of the set of hashes held, as
    ``BlockPool.take_events`` does for the device pool.
    """

    def __init__(self, spec: KVCacheSpec, num_slots: int, *, pin_memory: bool = False,
                 on_evict: Callable[[TierEntry], None] | None = None,
                 cache: KVCache | None = None) -> None:  # fmt: skip
        """``cache``: the slots' memory when the caller has it (a tensor-parallel rank's pool file)."""
        if num_slots <= 0:
            raise ValueError(f"a host tier needs at least one block, got {num_slots}")
        if cache is None:
            # empty, not zeros: a slot is read only after a copy wrote it, and untouched pages of an unpinned
            # buffer take no memory, so a tier sized for the worst case costs only what it holds
            buffer = torch.empty(spec.total_bytes(num_slots), dtype=torch.uint8, pin_memory=pin_memory)
            cache = KVCache(spec, num_slots, "cpu", buffer=buffer)
        self.cache = cache
        self.views = self.cache.layers
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: low slots first, often in runs
        self.entries: OrderedDict[str, TierEntry] = OrderedDict()  # LRU order: front is evicted first
        self.on_evict = on_evict
        self._pending: dict[str, bool] = {}

    @property
    def num_slots(self) -> int:
        return self.cache.num_blocks

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def num_available(self) -> int:
        """Slots that could be handed out now: free ones plus those of unpinned entries."""
        return len(self._free) + sum(1 for e in self.entries.values() if e.pins == 0)

    def lookup(self, block_hash: str, token_ids: tuple[int, ...], parent_hash: str) -> TierEntry | None:
        entry = self.entries.get(block_hash)
        if entry is None or entry.token_ids != token_ids or entry.parent_hash != parent_hash:
            return None
        return entry

    def touch(self, entry: TierEntry) -> None:
        self.entries.move_to_end(entry.block_hash)

    def add(self, block_hash: str, parent_hash: str, token_ids: tuple[int, ...]) -> TierEntry | None:
        """A new entry whose slot the caller fills now; None when every slot is pinned or swapped out. A
        different entry under the same hash (a stale chain) is replaced."""
        old = self.entries.get(block_hash)
        if old is not None:
            if old.pins:
                return None
            self._drop(old)
        slots = self.take_slots(1)
        if slots is None:
            return None
        entry = self.entries[block_hash] = TierEntry(block_hash, parent_hash, token_ids, slots[0])
        if old is None:
            self._note(block_hash, held=True)
        return entry

    def take_slots(self, n: int) -> list[int] | None:
        """``n`` slots for the caller alone (evicting unpinned entries, least recently used first), or None and
        nothing changed when there are not that many."""
        if n > self.num_available():
            return None
        while len(self._free) < n:
            victim = next(e for e in self.entries.values() if e.pins == 0)
            if self.on_evict is not None:
                self.on_evict(victim)
            self.remove(victim)
        return [self._free.pop() for _ in range(n)]

    def free_slots(self, slots: Sequence[int]) -> None:
        self._free.extend(slots)

    def remove(self, entry: TierEntry) -> None:
        """Forget ``entry`` (evicted, or found corrupt) and free its slot."""
        self._drop(entry)
        self._note(entry.block_hash, held=False)

    def _drop(self, entry: TierEntry) -> None:
        del self.entries[entry.block_hash]
        self._free.append(entry.slot)

    def hashes(self) -> list[str]:
        return list(self.entries)

    def take_events(self) -> tuple[list[str], list[str]]:
        """(hashes added, hashes evicted) since the last call: the net change."""
        added = [h for h, held in self._pending.items() if held]
        evicted = [h for h, held in self._pending.items() if not held]
        self._pending.clear()
        return added, evicted

    def _note(self, block_hash: str, held: bool) -> None:
        if self._pending.get(block_hash) is (not held):
            del self._pending[block_hash]
        else:
            self._pending[block_hash] = held


def available_host_bytes() -> int | None:
    """Memory this process can still get: the machine's ``MemAvailable``, or less where a cgroup (a container's
    memory limit) leaves less; None where neither can be read."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            pass
    try:  # cgroup v2: the limit ("max": none) less what the group uses now
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read())
        if limit != "max":
            left = max(0, int(limit) - current)
            available = left if available is None else min(available, left)
    except (OSError, ValueError):
        pass
    return available


def auto_host_bytes(pool_bytes: int, available: int | None) -> int:
    """The host tier's size when the config leaves it unset (see ``AUTO_HOST_RATIO``)."""
    nbytes = min(AUTO_HOST_RATIO * pool_bytes, AUTO_HOST_MAX_BYTES)
    if available is not None:
        nbytes = min(nbytes, int(available * AUTO_HOST_AVAILABLE_SHARE))
    return nbytes


def host_tier_bytes(gb: float | None, pool_bytes: int, block: int) -> int:
    """Bytes of the host tier: ``gb`` GiB as asked, or unset the automatic size (``auto_host_bytes``); 0 for
    none. ValueError for an asked size that holds no block or is more than the memory available."""
    available = available_host_bytes()
    if gb is None:
        nbytes = auto_host_bytes(pool_bytes, available)
        if nbytes < block:
            log.info("no host KV tier: too little host memory available for one block")
            return 0
        log.info("host KV tier: %.2f GiB (automatic: host_kv_cache_gb sets it, 0 turns it off)", nbytes / (1 << 30))
        return nbytes
    nbytes = int(gb * (1 << 30))
    if nbytes and nbytes < block:
        raise ValueError(f"host_kv_cache_gb={gb} holds no block: one block needs {block / (1 << 20):.2f} MiB")
    if available is not None and nbytes > available:
        raise ValueError(f"host_kv_cache_gb={gb} is more than this machine's available memory "
                         f"({available / (1 << 30):.1f} GiB): lower it")  # fmt: skip
    return nbytes
