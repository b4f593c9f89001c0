"""A worker process's life, shared by both roles: start serving, register, run the engine loop on the main
thread, and on SIGTERM or SIGINT drain (not serving, deregistered, running requests finish), then exit.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import uuid
from typing import Protocol

from cluster_state.publisher import PrefixPublisher
from cluster_state.registry import Registry
from cluster_state.workers import WorkerInfo, local_host_id
from engine import LLMEngine
from engine.heap import freeze_startup_heap, keep_freed_memory
from rpc import metrics, tracing
from rpc.loop import AsyncioThread, Loop
from rpc.server import add_service, new_server, set_not_serving, start_server
from rpc.threads import set_compute_threads
from rpc.worker_options import WorkerSettings
from security.auth import Security, security_from_settings

log = logging.getLogger(__name__)


class Worker(Protocol):
    loop: Loop
    engine: LLMEngine

    def info(self) -> WorkerInfo: ...
    def load(self) -> dict[str, int]: ...
    def drain(self, timeout_s: float) -> None: ...
    def stop(self) -> None: ...


def prepare_worker(settings: WorkerSettings, role: str) -> tuple[str, Security, Registry | None]:
    """What both roles do before loading a model: logging, credentials (exit with the reason when they are
    missing or wrong), the worker id (with a cluster certificate: the name it gives, which peers verify),
    tracing (``rpc.tracing``), the registry client and this worker's share of the cores."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(levelname)s %(message)s")
    try:
        security = security_from_settings(settings, role)
    except ValueError as err:
        sys.exit(f"{role} worker: {err}")
    named = security.identity.name if security.identity is not None else None
    if settings.worker_id and named and settings.worker_id != named:
        sys.exit(f"{role} worker: --worker-id {settings.worker_id} differs from the name in its certificate "
                 f"({named}), which peers check")  # fmt: skip
    worker_id = settings.worker_id or named or f"{role}-{uuid.uuid4().hex[:8]}"
    tracing.setup(role, worker_id, settings)
    registry = Registry(settings.redis_url, security=security) if settings.redis_url else None
    compute_threads(settings, registry, worker_id)
    return worker_id, security, registry


def compute_threads(settings: WorkerSettings, registry: Registry | None, worker_id: str) -> int:
    """Set this worker's torch threads: ``--threads``, else its share of the host with the other compute workers
    the registry knows on this host (``kvserve up`` always passes ``--threads``). A restarted worker's own
    entry from its previous life is not another worker."""
    others = 0
    if settings.threads is None and settings.compute_lease is None and registry is not None:
        host = local_host_id()
        others = sum(w.host_id == host and w.worker_id != worker_id for w in registry.workers()
                     if w.role in ("prefill", "decode"))  # fmt: skip
    return set_compute_threads(settings.threads, others + 1, leased=settings.compute_lease is not None)


def serve(worker: Worker, services: dict[str, object], aio: AsyncioThread, security: Security,
          settings: WorkerSettings, registry: Registry | None, cleanups: list) -> None:  # fmt: skip
    """Serve ``services`` on ``--host:--port`` until a signal, running ``worker.loop`` on this thread."""

    async def start():
        server = new_server(security)
        names = [add_service(server, name, servicer) for name, servicer in services.items()]
        _, health = await start_server(server, names, f"{settings.host}:{settings.port}", security)
        return server, health, names

    server, health, names = aio.run(start())
    info = worker.info()
    metrics.export_state(info.role, worker.load, worker.engine)
    metrics_port = metrics.start_metrics_server(settings.host, settings.metrics_port)
    log.info("%s %s: metrics on http://%s:%d/metrics", info.role, info.worker_id, settings.host, metrics_port)
    publisher = None
    if registry is not None:
        metrics.export_registry_health(info.role, registry)
        registry.register(info)
        # the prefix index: the loop hands its engine's block events over, a thread of their own applies them
        publisher = PrefixPublisher(registry.prefix_index, info.worker_id, worker.engine.held_block_hashes)

        def publish() -> None:
            publisher.publish(*worker.engine.take_prefix_events())
            for tier, (stored, evicted) in worker.engine.take_tier_events().items():
                publisher.publish(stored, evicted, tier)

        worker.loop.add_hook(publish)

        def resync() -> None:  # Redis lost our state: leases in flight (decode) and every cached block
            getattr(worker, "resync", lambda: None)()
            publisher.resync()

        registry.start_heartbeat(worker.load, on_resync=resync)

    deregister = threading.Thread(target=registry.stop if registry else lambda: None, name="deregister")

    def on_signal(signum, _frame) -> None:
        log.info("%s: draining for up to %.0f s", signal.Signals(signum).name, settings.drain_timeout)
        aio.submit(set_not_serving(health, names))
        if not deregister.is_alive() and deregister.ident is None:  # routers stop choosing us; Redis I/O
            deregister.start()  # stays off this (the engine loop's) thread
        worker.drain(settings.drain_timeout)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    log.info("%s %s: %d objects of start-up frozen out of garbage collection", info.role, info.worker_id,
             freeze_startup_heap())  # fmt: skip
    keep_freed_memory()  # (engine.heap: no step faults its activations back in)
    worker.loop.run()
    aio.run(server.stop(grace=1.0), timeout_s=10)
    worker.stop()
    if deregister.ident is None:
        deregister.start()
    deregister.join(timeout=5)
    if publisher is not None:
        publisher.stop()
    for cleanup in cleanups:
        cleanup()
    aio.stop()
    tracing.shutdown()
    log.info("stopped")
