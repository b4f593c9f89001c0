"""The ``nixl`` transport (another host, or forced: any host; DRAM or VRAM): one NIXL WRITE per hand-off.

Push, not pull. The prefill worker writes the finished blocks from its own pool into the decode worker's
leased blocks, as ``shm`` and ``cuda_ipc`` do, so the lease keeps one meaning whatever the transport: the
decode worker grants a writer some blocks until a deadline, and the writer ends the lease once it will never
write again (``Backend.writes_in_place``). The KV moves once, while the prefill worker still holds its
blocks (``take``, before the engine releases them), with no staging copy and no extra round trip; pulling
(vLLM's model) would make the prefill worker keep its blocks until a decode worker comes to read them, and
add a second lease in the other direction.

* The decode worker registers its whole pool (``KVCache.buffer``) with one agent at start-up (``NixlPool``)
  and offers the agent's metadata and the pool's address only inside the signed lease
  (``KVDestination.nixl_metadata``, ``nixl_pool``), over authenticated gRPC. No NIXL metadata listener runs.
* The prefill worker's agent (one per worker, ``_local_agent``) registers its own pool on first use, loads a
  decode worker's metadata once per pool (``NixlTransport.open``), and writes each hand-off's blocks with a
  notification naming the request. ``take`` waits for the write to complete (or fails it at the lease's write
  deadline), so the lease ends after the last byte, and returns the checksum of the source blocks.
* The decode worker trusts that checksum only once the notification from that writer has arrived
  (``NixlPool.arrived``; ``decode_service.remote_prefill``), then verifies its own copy against it.

NIXL/UCX authenticates nothing on the data path: this is for a trusted cluster fabric (README, trust model).
Without NIXL installed the module still imports (``transfer.backend.nixl_installed()`` is False), and ``open``
refuses.

Starting an agent costs about 2 s of CPU (UCX), so a worker starts its own only when it first needs it: the
prefill worker on its first ``nixl`` destination, the decode worker when it first chooses ``nixl`` for a peer
(``NixlOffer``; grpc meanwhile) or at start-up when ``--kv-transport nixl`` forces it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from kvstore.kv_cache import KVCache, KVCacheSpec
from protos.kvserve.v1 import kvserve_pb2 as pb
from transfer.backend import Backend
from transfer.blocks import checksum_blocks
from transfer.interface import KVTransport, Origin, TransferFailed

WRITE_TIMEOUT_S = 30.0  # a write's limit when the caller names no deadline
_POLL_S = 0.0002

log = logging.getLogger(__name__)


def _nixl() -> ModuleType | None:
    """NIXL's Python API: ``nixl_cu12`` (PyPI's ``nixl-cu12``) or ``nixl``; None when neither imports."""
    for name in ("nixl_cu12", "nixl._api"):
        try:
            return __import__(name, fromlist=["nixl_agent"])
        except ImportError:
            continue
    return None


def _agent(worker_id: str):  # noqa: ANN202 - nixl_agent, whose module may be absent
    """A new agent named after ``worker_id`` (plus a random suffix: a restarted worker's agent is a new peer),
    with no metadata listener, thread-safe calls (the event loop and the batcher both use it) and a progress
    thread that rests when there is nothing to progress (``_resting_progress_thread``)."""
    nixl = _nixl()
    if nixl is None:
        raise RuntimeError("NIXL is not installed here (pip install 'kvserve[nixl]')")
    config = nixl.nixl_agent_config(enable_prog_thread=True, enable_listen_thread=False, backends=["UCX"],
                                    sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)  # fmt: skip
    with _resting_progress_thread(nixl):
        return nixl.nixl_agent(f"{worker_id}#{secrets.token_hex(4)}", config)


PROGRESS_REST_US = 100  # the progress thread's pause when a round progressed nothing
_config_lock = threading.Lock()


@contextmanager
def _resting_progress_thread(nixl: ModuleType) -> Iterator[None]:
    """Agents made meanwhile get ``PROGRESS_REST_US`` as their progress thread's delay.

    NIXL's Python API (``nixl_agent``) sets that delay to 0, and its progress thread then polls UCX without
    pause: one whole core per agent, busy or idle (measured here: 5.0 s of CPU in 5 s idle; 0.17 s with
    100 us). On this 2-core machine that starves the engines, and on a GPU host it burns a core per worker.
    The API has no parameter for it, so the agent's config class is swapped, for the construction only, for
    one that keeps our delay."""
    api = importlib.import_module(nixl.nixl_agent.__module__)
    bindings = getattr(api, "nixlBind", None)
    base = getattr(bindings, "nixlAgentConfig", None)
    if base is None:  # another NIXL build: its own delay stands
        yield
        return

    class _Resting(base):
        def __setattr__(self, name: str, value: object) -> None:
            super().__setattr__(name, PROGRESS_REST_US if name == "pthrDelay" else value)

    with _config_lock:
        bindings.nixlAgentConfig = _Resting
        try:
            yield
        finally:
            bindings.nixlAgentConfig = base


def writer_of(agent_name: str) -> str:
    """The worker id an agent name of ``_agent`` belongs to."""
    return agent_name.rpartition("#")[0]


def _where(buffer: torch.Tensor) -> tuple[str, int]:
    """(NIXL memory type, device id) of a pool buffer."""
    return ("VRAM", buffer.device.index or 0) if buffer.device.type == "cuda" else ("DRAM", 0)


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


def _descs(base: int, device: int, layout: list[tuple[int, int]], starts: np.ndarray, runs: np.ndarray) -> np.ndarray:
    """(address, length, device) rows: each run of ``runs[i]`` blocks from block ``starts[i]``, in every region."""
    rows = [np.stack([base + offset + starts * stride, runs * stride, np.full_like(starts, device)], axis=1)
            for offset, stride in layout]  # fmt: skip
    return np.concatenate(rows).astype(np.uint64)


def _runs(src: list[int], dst: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pairs of consecutive block runs: (source starts, destination starts, lengths). One descriptor per run
    and region instead of one per block."""
    s, d = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    first = np.concatenate([[0], breaks])
    lengths = np.diff(np.concatenate([first, [len(s)]]))
    return s[first], d[first], lengths


class NixlPool:
    """The decode worker's pool, registered with its agent once, for the life of the worker."""

    def __init__(self, cache: KVCache, worker_id: str) -> None:
        self.agent = _agent(worker_id)
        self._registered = self.agent.register_memory(cache.buffer)
        mem, device = _where(cache.buffer)
        self.metadata: bytes = self.agent.get_agent_metadata()
        self.pool = f"{mem}:{device}:{cache.buffer.data_ptr()}"  # ``KVDestination.nixl_pool``
        self._cache = cache  # keeps the registered buffer alive

    def arrived(self) -> list[tuple[str, str]]:
        """(writer's worker id, request id) of every notification since the last call: a write of that
        request's blocks by that writer completed. One thread calls this (the decode loop)."""
        return [(writer_of(name), msg.decode(errors="replace"))
                for name, msgs in self.agent.get_new_notifs().items() for msg in msgs]  # fmt: skip

    def close(self) -> None:
        self.agent.deregister_memory(self._registered)


class NixlOffer:
    """The decode worker's ``NixlPool``, registered at once (``eager``) or in the background on first need."""

    def __init__(self, cache: KVCache, worker_id: str, eager: bool) -> None:
        self._args = (cache, worker_id)
        self._pool: NixlPool | None = NixlPool(cache, worker_id) if eager else None
        self._starting: threading.Thread | None = None

    def ready(self) -> NixlPool | None:
        """The registered pool, or None while it is not (yet): the first call starts registering it."""
        if self._pool is None and self._starting is None:
            self._starting = threading.Thread(target=self._start, name="nixl-start", daemon=True)
            self._starting.start()
        return self._pool

    def _start(self) -> None:
        try:
            self._pool = NixlPool(*self._args)
            log.info("KV pool registered with NIXL agent %s", self._pool.agent.name)
        except Exception:  # noqa: BLE001 - nixl stays unoffered: every hand-off goes on over grpc
            log.exception("registering the KV pool with NIXL failed; hand-offs use grpc")


class _LocalAgent:
    """A prefill worker's agent and the pools of its own it registered (by buffer address)."""

    def __init__(self, worker_id: str) -> None:
        self.agent = _agent(worker_id)
        self._registered: dict[int, object] = {}
        self._lock = threading.Lock()

    def register(self, cache: KVCache) -> None:
        with self._lock:
            if cache.buffer.data_ptr() not in self._registered:
                self._registered[cache.buffer.data_ptr()] = (self.agent.register_memory(cache.buffer), cache)


_agents: dict[str, _LocalAgent] = {}  # by prefill worker id: a process may run several (tests, benchmarks)
_agents_lock = threading.Lock()


def _local_agent(worker_id: str) -> _LocalAgent:
    with _agents_lock:
        if worker_id not in _agents:
            _agents[worker_id] = _LocalAgent(worker_id)
        return _agents[worker_id]


@dataclass(frozen=True)
class Written:
    """What ``take`` did: the checksum of the source blocks once written, or why the write failed."""

    checksum: str = ""
    error: str = ""


class NixlTransport(KVTransport):
    """One decode worker's registered pool, as this prefill worker's agent reaches it. Closing it unloads
    that agent's metadata (and disconnects from it)."""

    backend = Backend.NIXL

    def __init__(self, worker_id: str, local: _LocalAgent, remote: str, pool: str, spec: KVCacheSpec,
                 num_blocks: int) -> None:  # fmt: skip
        super().__init__(worker_id)
        self.local, self.remote = local, remote
        mem, device, address = pool.split(":")
        self.mem, self.device, self.base = mem, int(device), int(address)
        self.layout = region_layout(spec, num_blocks)

    @staticmethod
    def key(dest: pb.KVDestination) -> str:
        digest = hashlib.sha256(dest.nixl_metadata + dest.nixl_pool.encode()).hexdigest()[:16]
        return f"nixl:{dest.worker_id}:{digest}"

    @classmethod
    def open(cls, dest: pb.KVDestination, origin: Origin) -> NixlTransport:
        if not dest.nixl_metadata or dest.nixl_pool.count(":") != 2 or dest.nixl_pool.split(":")[0] not in (
                "DRAM", "VRAM"):  # fmt: skip
            raise ValueError("the destination offers no NIXL agent and pool")
        local = _local_agent(origin.worker_id)
        remote = local.agent.add_remote_agent(dest.nixl_metadata)
        remote = remote.decode() if isinstance(remote, bytes) else remote
        if writer_of(remote) != dest.worker_id:
            local.agent.remove_remote_agent(remote)
            raise ValueError(f"the NIXL agent {remote!r} is not decode worker {dest.worker_id!r}'s")
        return cls(dest.worker_id, local, remote, dest.nixl_pool, origin.spec, dest.num_blocks)

    def take(self, source: KVCache, block_ids: list[int], request_id: str = "", dst_blocks: list[int] = (),
             deadline: float | None = None) -> Written:  # fmt: skip
        """Write ``block_ids`` of ``source`` into ``dst_blocks`` (one to one), with a notification naming
        ``request_id``, and wait for it; at ``deadline`` (monotonic) an unfinished write is cancelled. Never
        raises: a failure is reported by ``finish``, and returns only once no byte of it can still land."""
        if len(block_ids) != len(dst_blocks):
            return Written(error=f"{len(block_ids)} source blocks for {len(dst_blocks)} leased ones")
        if not block_ids:
            return Written(checksum="")
        deadline = min(deadline if deadline is not None else float("inf"), time.monotonic() + WRITE_TIMEOUT_S)
        try:
            self.local.register(source)
            agent = self.local.agent
            src_starts, dst_starts, runs = _runs(block_ids, dst_blocks)
            mem, device = _where(source.buffer)
            local = agent.get_xfer_descs(_descs(source.buffer.data_ptr(), device, region_layout(source.spec,
                                         source.num_blocks), src_starts, runs), mem)  # fmt: skip
            remote = agent.get_xfer_descs(_descs(self.base, self.device, self.layout, dst_starts, runs), self.mem)
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
