"""NIXL agents (``transfer.nixl``): starting one, with a progress thread that rests; the prefill worker's own
agent, one per worker, and the pools it registered; and the decode worker's pool, registered with its agent
once (``NixlPool``), at start-up or in the background on first need (``NixlOffer``).

Starting an agent costs about 2 s of CPU (UCX), so a worker starts its own only when it first needs it: the
prefill worker on its first ``nixl`` destination, the decode worker when it first chooses ``nixl`` for a peer
(``NixlOffer``; grpc meanwhile) or at start-up when ``--kv-transport nixl`` forces it.
"""

from __future__ import annotations

import importlib.util
import logging
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import torch

from kvstore.kv_cache import KVCache
from kvstore.split_pool import SplitPool

log = logging.getLogger(__name__)


def _nixl() -> ModuleType | None:
    """NIXL's Python API: ``nixl_cu12`` (PyPI's ``nixl-cu12``) or ``nixl``; None when neither imports."""
    for name in ("nixl_cu12", "nixl._api"):
        try:
            return __import__(name, fromlist=["nixl_agent"])
        except ImportError:
            continue
    return None


def new_agent(worker_id: str):  # noqa: ANN202 - nixl_agent, whose module may be absent
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
    """The worker id an agent name of ``new_agent`` belongs to."""
    return agent_name.rpartition("#")[0]


def memory_of(buffer: torch.Tensor) -> tuple[str, int]:
    """(NIXL memory type, device id) of a pool buffer."""
    return ("VRAM", buffer.device.index or 0) if buffer.device.type == "cuda" else ("DRAM", 0)


class NixlPool:
    """The decode worker's pool, registered with its agent once, for the life of the worker."""

    def __init__(self, pool: SplitPool | KVCache, worker_id: str) -> None:
        pool = SplitPool.of(pool)  # (an unsplit pool is one part)
        self.agent = new_agent(worker_id)
        mem, device = memory_of(pool.parts[0].buffer)
        try:
            self._registered = [self.agent.register_memory(part.buffer) for part in pool.parts]
        except Exception as error:  # noqa: BLE001 - nixl's own backend error names no cause
            hint = (" (seen on a GPU machine whose NIXL wheel's UCX was built without CUDA: it takes GPU memory "
                    "for host memory)") if mem == "VRAM" else ""
            mib = pool.spec.total_bytes(pool.num_blocks) / 2**20
            raise RuntimeError(f"NIXL could not register the KV pool ({mem}, {mib:.0f} MiB){hint}: use --kv-transport "
                               "grpc, or a NIXL whose UCX has CUDA") from error
        self.metadata: bytes = self.agent.get_agent_metadata()
        # ``KVDestination.nixl_pool``: each part's buffer, ``;``-separated (with ``kv_heads``: one per rank)
        self.pool = ";".join(f"{mem}:{device}:{part.buffer.data_ptr()}" for part in pool.parts)
        self._pool = pool  # keeps the registered buffers alive

    def arrived(self) -> list[tuple[str, str]]:
        """(writer's worker id, request id) of every notification since the last call: a write of that
        request's blocks by that writer completed. One thread calls this (the decode loop)."""
        return [(writer_of(name), msg.decode(errors="replace"))
                for name, msgs in self.agent.get_new_notifs().items() for msg in msgs]  # fmt: skip

    def close(self) -> None:
        for registered in self._registered:
            self.agent.deregister_memory(registered)


class NixlOffer:
    """The decode worker's ``NixlPool``, registered at once (``eager``) or in the background on first need."""

    def __init__(self, pool: SplitPool, worker_id: str, eager: bool) -> None:
        self._args = (pool, worker_id)
        self._pool: NixlPool | None = NixlPool(pool, worker_id) if eager else None
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


class LocalAgent:
    """A prefill worker's agent and the pools of its own it registered (by buffer address)."""

    def __init__(self, worker_id: str) -> None:
        self.agent = new_agent(worker_id)
        self._registered: dict[int, object] = {}
        self._lock = threading.Lock()

    def register(self, cache: KVCache) -> None:
        with self._lock:
            if cache.buffer.data_ptr() not in self._registered:
                self._registered[cache.buffer.data_ptr()] = (self.agent.register_memory(cache.buffer), cache)


_agents: dict[str, LocalAgent] = {}  # by prefill worker id: a process may run several (tests, benchmarks)
_agents_lock = threading.Lock()


def local_agent(worker_id: str) -> LocalAgent:
    with _agents_lock:
        if worker_id not in _agents:
            _agents[worker_id] = LocalAgent(worker_id)
        return _agents[worker_id]
