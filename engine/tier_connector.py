"""Memory tiers below the KV pool, as the engine's KV connector: host (L2) and, optionally, disk (L3).

* **Evicted blocks go down.** The block manager records every cached block the pool hands out again
  (``BlockManager.take_evicted``); before anything can write over them (the next admission's loads or a
  remote writer, the step's model run) they are copied into the host tier in one batch (``_save_evicted``).
  The host tier's own LRU evicts into the disk tier, when there is one.
* **A prefix hit below the pool is loaded back.** At admission, after the pool's own cached prefix, the
  walk goes on block by block in the host tier, then the disk tier (a disk hit is read into a host slot
  first, checksum-verified); those tokens count as computed (``num_external_tokens``) and are copied into
  the sequence's new blocks as soon as they are allocated (``after_allocate``), before any later connector
  (a remote prefill that may read them in place) is told about them. A load is a copy of a few MiB: on a
  GPU it runs on a copy stream the next step's kernels wait for, and the host waits only when another
  connector follows.
* **Swap preemption.** A preempted sequence's computed KV is copied into host slots of its own (never
  evicted) instead of being dropped, and loaded back like a prefix hit when it is admitted again. The policy
  is a token threshold: ``auto`` swaps a sequence with at least two full blocks computed while the host tier
  has slots for it and recomputes shorter ones (their recompute is a fraction of one step), ``swap`` swaps
  whenever there is room, ``recompute`` never swaps.

A tier entry is matched on its chained hash, token ids and parent hash, so a stale or colliding entry is a
miss (recompute), never wrong KV.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.kv_connector import KVConnector
from engine.sequence import Sequence
from kvstore import BlockManager, LayerKV
from kvstore.block_copier import BlockCopier
from kvstore.host_tier import HostTier, TierEntry, host_tier_bytes
from kvstore.prefix_hash import block_hashes
from kvstore.split_pool import SplitPool

SWAP_MIN_BLOCKS = 2  # ``auto``: shorter preempted sequences are recomputed


@dataclass
class TierStats:
    """Counters since start: prompt tokens each tier served at admission, blocks moved, preemptions."""

    hit_tokens: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0})
    blocks_saved: int = 0  # device -> host, evicted cached blocks
    blocks_loaded: int = 0  # host -> device, prefix hits and swap-ins
    swapped_out: int = 0  # preemptions that swapped
    recomputed: int = 0  # preemptions that dropped the KV
    corrupt: int = 0  # disk entries refused on load


@dataclass
class _Plan:
    """What ``after_allocate`` copies into a sequence's blocks: host slots for its blocks from ``first_block``."""

    first_block: int
    slots: list[int]
    entries: list[TierEntry]  # pinned until copied (prefix hits); empty for a swap-in
    swap: bool
    num_cached_tokens: int = 0  # the device pool's own hit before them
    tiers: list[str] = field(default_factory=list)  # where each entry was found: "host" or "disk"


class TierConnector(KVConnector):
    def __init__(self, block_manager: BlockManager, device_views: list[LayerKV], host: HostTier, copier: BlockCopier,
                 disk=None, preemption_mode: str = "auto", then_remote: bool = False,
                 host_pool: SplitPool | None = None) -> None:  # fmt: skip
        self.block_manager = block_manager
        self.host_pool = host_pool or SplitPool([host.cache])  # what the disk tier reads: every rank's part
        self.block_size = block_manager.block_size
        self.views = device_views
        self.host, self.copier, self.disk = host, copier, disk
        self.preemption_mode = preemption_mode
        self.then_remote = then_remote  # another connector may read loaded blocks from another process
        self.stats = TierStats()
        self._plans: dict[str, _Plan] = {}
        self._swapped: dict[str, tuple[list[int], int]] = {}  # seq id -> (host slots, tokens they hold)
        host.on_evict = self._demote

    # -- scheduler side ----------------------------------------------------------------------------------

    def num_external_tokens(self, seq: Sequence, num_cached_tokens: int) -> tuple[int, bool]:
        self._drop_plan(seq.seq_id)
        bs = self.block_size
        swapped = self._swapped.get(seq.seq_id)
        if swapped is not None:
            slots, num_tokens = swapped
            first = num_cached_tokens // bs
            if num_tokens <= num_cached_tokens:
                self._release_swap(seq.seq_id)
                return 0, False
            self._plans[seq.seq_id] = _Plan(first, slots[first : -(-num_tokens // bs)], [], True, num_cached_tokens)
            return num_tokens - num_cached_tokens, False
        plan = self._plans[seq.seq_id] = _Plan(num_cached_tokens // bs, [], [], False, num_cached_tokens)
        first, limit = plan.first_block, (seq.num_tokens - 1) // bs  # one token is left to compute
        if not self.block_manager.enable_caching or first >= limit:
            return 0, False
        tokens = seq.token_ids
        hashes = block_hashes(tokens[: limit * bs], bs, self.block_manager.salt)
        for i in range(first, limit):
            parent = hashes[i - 1] if i else ""
            block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
            entry = self.host.lookup(hashes[i], block_tokens, parent)
            tier = "host"
            if entry is None and self.disk is not None:
                entry, tier = self._promote(hashes[i], parent, block_tokens), "disk"
            if entry is None:
                break
            entry.pins += 1
            self.host.touch(entry)
            plan.entries.append(entry)
            plan.slots.append(entry.slot)
            plan.tiers.append(tier)
        return len(plan.entries) * bs, False

    def after_allocate(self, seq: Sequence, num_external_tokens: int) -> None:
        self._save_evicted()  # the new blocks may be evicted ones: their KV goes down before anything lands
        plan = self._plans.pop(seq.seq_id, None)
        if plan is None:
            if self.then_remote:
                self.copier.synchronize()
            return
        if seq.num_preemptions == 0:  # a first admission: what served its prompt
            self.stats.hit_tokens["device"] += plan.num_cached_tokens
            for tier in plan.tiers:
                self.stats.hit_tokens[tier] += self.block_size
        if num_external_tokens:
            blocks = seq.block_table[plan.first_block : plan.first_block + len(plan.slots)].tolist()
            self.copier.to_device(self.host.views, plan.slots, self.views, blocks)
            self.stats.blocks_loaded += len(blocks)
        for entry in plan.entries:
            entry.pins -= 1
        if plan.swap:
            self._release_swap(seq.seq_id)
        if self.then_remote:  # another process may write the blocks we copy out of, or read those we load
            self.copier.synchronize()

    def request_finished(self, seq: Sequence) -> bool:
        self._drop_plan(seq.seq_id)
        self._release_swap(seq.seq_id)
        return False

    def preempt(self, seq: Sequence) -> None:
        self._save_evicted()
        self._drop_plan(seq.seq_id)
        bs = self.block_size
        num_tokens = seq.num_computed_tokens
        n = -(-num_tokens // bs)
        wanted = seq.ring is None and (  # (a ring's blocks are not in the sequence's order: kvstore.ring)
            self.preemption_mode == "swap" or (self.preemption_mode == "auto" and num_tokens >= SWAP_MIN_BLOCKS * bs)
        )
        slots = self.host.take_slots(n) if wanted and n else None
        if slots is None:
            self.stats.recomputed += 1
            return
        self.copier.to_host(self.views, seq.block_table[:n].tolist(), self.host.views, slots)
        self._swapped[seq.seq_id] = (slots, num_tokens)
        self.stats.swapped_out += 1

    # -- runner side -------------------------------------------------------------------------------------

    def start_loads(self, admitted: list[Sequence]) -> None:
        self._save_evicted()  # blocks a decode step took over are written by this step
        for seq_id in list(self._plans):  # admissions that found no blocks after all
            self._drop_plan(seq_id)
        self.copier.wait_for_copies()

    # -- what the tiers hold (for the cluster's prefix index) -----------------------------------------------

    def take_events(self) -> dict[str, tuple[list[str], list[str]]]:
        events = {"host": self.host.take_events()}
        if self.disk is not None:
            events["disk"] = self.disk.take_events()
        return events

    def held(self) -> dict[str, list[str]]:
        held = {"host": self.host.hashes()}
        if self.disk is not None:
            held["disk"] = self.disk.hashes()
        return held

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    # -- internals ---------------------------------------------------------------------------------------

    def _save_evicted(self) -> None:
        evicted = self.block_manager.take_evicted()
        fresh = []
        for ev in evicted:
            entry = self.host.lookup(ev.block_hash, ev.token_ids, ev.parent_hash)
            if entry is not None:
                self.host.touch(entry)
            else:
                fresh.append(ev)
        if self.disk is None:  # what does not fit would only push the newest out again: keep the newest
            fresh = fresh[max(0, len(fresh) - self.host.num_available()) :]
        while fresh:  # oldest first, a batch at a time: a batch pushes the one before it down to disk
            room = self.host.num_available()
            if not room:
                return
            batch, fresh = fresh[:room], fresh[room:]
            blocks, slots = [], []
            for ev in batch:
                entry = self.host.add(ev.block_hash, ev.parent_hash, ev.token_ids)
                if entry is not None:
                    blocks.append(ev.block_id)
                    slots.append(entry.slot)
            self.copier.to_host(self.views, blocks, self.host.views, slots)
            self.stats.blocks_saved += len(blocks)

    def _promote(self, block_hash: str, parent_hash: str, token_ids: tuple[int, ...]) -> TierEntry | None:
        """A disk hit read into a new host entry, or None (not there, corrupt, or no host slot free)."""
        if not self.disk.lookup(block_hash, token_ids, parent_hash):
            return None
        self.copier.synchronize()  # the slot may be one a copy still writes
        entry = self.host.add(block_hash, parent_hash, token_ids)
        if entry is None:
            return None
        if not self.disk.load(block_hash, token_ids, parent_hash, self.host_pool, entry.slot):
            self.stats.corrupt += 1
            self.host.remove(entry)
            return None
        return entry

    def _demote(self, entry: TierEntry) -> None:
        if self.disk is None:
            return
        self.copier.synchronize()  # its slot may still be arriving
        self.disk.store(entry.block_hash, entry.parent_hash, entry.token_ids, self.host_pool, entry.slot)

    def _drop_plan(self, seq_id: str) -> None:
        plan = self._plans.pop(seq_id, None)
        if plan is not None:
            for entry in plan.entries:
                entry.pins -= 1

    def _release_swap(self, seq_id: str) -> None:
        swapped = self._swapped.pop(seq_id, None)
        if swapped is not None:
            self.host.free_slots(swapped[0])


def build_tiers(config, spec, device: torch.device, block_manager: BlockManager, views: list[LayerKV],
                fingerprint: str, ranks=None) -> TierConnector | None:  # fmt: skip
    """The engine's memory tiers as its config asks, or None (no host tier); ValueError for a bad config. With
    tensor-parallel ``ranks`` (``spec`` is rank 0's) each rank keeps as many slots, every copy is made on each,
    and the disk tier holds whole heads (``kvstore.split_pool``): files one TP size wrote serve another."""
    if config.disk_kv_cache_gb and not config.disk_kv_cache_dir:
        raise ValueError("disk_kv_cache_gb is set but disk_kv_cache_dir is not: name the directory for the disk tier")
    block = spec.bytes_per_block()
    nbytes = host_tier_bytes(config.host_kv_cache_gb, spec.total_bytes(block_manager.num_blocks), block)
    if not nbytes:
        if config.disk_kv_cache_dir:
            raise ValueError("disk_kv_cache_dir needs a host tier (the disk tier sits below it): host_kv_cache_gb=0 "
                             "turns it off, and unset it found too little memory available for one block")  # fmt: skip
        return None
    host = HostTier(spec, nbytes // block, pin_memory=device.type == "cuda")
    copier, host_pool = BlockCopier(device), SplitPool([host.cache])
    if ranks is not None:  # every rank's tier holds its heads; on the CPU this process maps them all
        copier, parts = ranks.host_tier(host.num_slots, copier, config.shared_kv_name or "engine")
        host_pool = SplitPool([host.cache, *parts]) if parts else None
    disk = None
    if config.disk_kv_cache_dir:
        from kvstore.disk_tier import DiskTier

        if host_pool is None:
            raise ValueError("disk_kv_cache_dir with tensor_parallel_size > 1 on CUDA: the ranks' host tiers are out "
                             "of this process's reach (on the CPU it works)")  # fmt: skip
        disk = DiskTier(config.disk_kv_cache_dir, fingerprint, int(config.disk_kv_cache_gb * 2**30), host_pool.spec)
    block_manager.pool.record_evictions = True
    return TierConnector(block_manager, views, host, copier, disk, config.preemption_mode, host_pool=host_pool)
