"""``python -m router --port 50051 [--http-port 8000] [--redis-url URL] [--decode-address HOST:PORT ...]
[--config FILE]``

Serves ``kvserve.v1.Inference``, health checking and reflection on one port, and the OpenAI-compatible HTTP
API (``router.openai_api``) on ``--http-port`` (0: none), both on one event loop and both with TLS when
``--tls-cert`` is given, and both behind the front door (``router.limits``: API keys and tenants, request size,
concurrency). SIGHUP reads ``--api-keys-file`` again (``router.tenants``). Prometheus ``/metrics`` is on the
HTTP port, or on ``--metrics-port`` when given. The router
calls the decode workers' internal service as a member of role ``router`` (``security.auth``): with its cluster
certificate (``--cluster-certs``) over mutual TLS, else with its credential's call token; ``--tls-*`` serve
its public port only (and its calls too, without ``--cluster-certs``). Every option is also a ``KVSERVE_*``
variable and a key of the ``--config`` file's ``router`` section (``model``, ``skip_tokenizer_init`` and
``max_model_len``: of its top level too), in that order of precedence after the flag (``engine.config_file``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import TYPE_CHECKING

from cluster_state.registry import Registry
from engine.bundled import resolve_model
from engine.heap import freeze_startup_heap
from engine.model_config import ModelConfig
from engine.tokenizer import Tokenizer
from router.limits import FrontDoor, PublicInference, front_door_from_settings
from router.routing import RoutingWeights
from router.server import Router
from router.settings import RouterSettings
from rpc import tracing
from rpc.metrics import export_registry_health, start_metrics_server
from rpc.server import add_service, exit_stopped_process, new_server, set_not_serving, start_server
from rpc.settings import parse_settings, settings_parser
from security.auth import Security, security_from_settings, tls_files

if TYPE_CHECKING:
    from router.http_server import HttpServer

log = logging.getLogger("router")


def main(argv: list[str] | None = None) -> None:
    parser = settings_parser(RouterSettings, "python -m router", __doc__, section="router")
    settings = parse_settings(RouterSettings, argv, parser.prog, __doc__, section="router")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s router %(levelname)s %(message)s")
    try:
        security = security_from_settings(settings, "router")
        public = Security(None, **tls_files(settings))
        door = front_door_from_settings(settings)
        weights = RoutingWeights(settings.route_block_weight, settings.route_host_block_weight,
                                 settings.route_disk_block_weight, settings.route_load_weight,
                                 settings.route_balance_threshold)  # fmt: skip
    except ValueError as err:
        parser.error(str(err))
    tracing.setup("router", "router", settings)
    path = resolve_model(settings.model)
    config = ModelConfig.from_dir(path)
    if settings.max_model_len and settings.max_model_len > config.max_context:
        parser.error(f"argument --max-model-len: {settings.max_model_len} exceeds the model's context of "
                     f"{config.max_context} tokens")  # fmt: skip
    max_context = settings.max_model_len or config.max_context
    registry = Registry(settings.redis_url, security=security) if settings.redis_url else None
    if registry is not None:
        export_registry_health("router", registry)
    tokenizer = None if settings.skip_tokenizer_init else Tokenizer(path)
    try:
        router = Router(tokenizer, config.vocab_size, max_context, security, registry,
                        settings.decode_address, weights=weights, migrate_streams=settings.migrate_streams,
                        stream_idle_timeout_s=settings.stream_idle_timeout,
                        max_validation_backlog=settings.max_validation_backlog,
                        fair_queue_slots=settings.fair_queue_slots if settings.api_keys_file else 0)  # fmt: skip
    except ValueError as err:
        parser.error(str(err))
    host = settings.host
    http = None
    if settings.http_port:
        from router.http_server import HttpServer  # fastapi and uvicorn: only for the HTTP API
        from router.openai_api import create_app

        names = settings.served_model_name or [path.name]
        app = create_app(router, names, door, serve_metrics=not settings.metrics_port, root=str(path),
                         tool_call_parser=settings.tool_call_parser)  # fmt: skip
        try:
            http = HttpServer(app, host, settings.http_port, settings.tls_cert, settings.tls_key, settings.tls_ca)
        except OSError as err:
            parser.error(f"cannot listen on {host}:{settings.http_port} for HTTP: {err.strerror}")
    if settings.metrics_port:
        try:
            start_metrics_server(host, settings.metrics_port)
        except OSError as err:
            parser.error(f"cannot listen on {host}:{settings.metrics_port} for /metrics: {err.strerror}")
        log.info("serving Prometheus /metrics on %s:%d", host, settings.metrics_port)
    log.info("%d objects of start-up frozen out of garbage collection", freeze_startup_heap())
    try:
        asyncio.run(serve(router, f"{host}:{settings.port}", public, settings.drain_timeout, http, door))
    finally:
        if registry is not None:
            registry.stop()
        tracing.shutdown()


async def serve(router: Router, address: str, public: Security, drain_timeout_s: float,
                http: HttpServer | None = None, door: FrontDoor | None = None) -> None:  # fmt: skip
    """Serve until SIGTERM or SIGINT, then stop taking calls and let open streams finish for a while. ``public``:
    the TLS files of the public port (no token: the public service has none)."""
    door = door or FrontDoor()
    server = new_server(public, max_receive_bytes=door.max_request_bytes)
    names = [add_service(server, "Inference", PublicInference(router, door))]
    _, health = await start_server(server, names, address, public)
    log.info("serving kvserve.v1.Inference on %s", address)
    if http is not None:
        await http.start()
        log.info("serving the OpenAI-compatible API on port %d (%s)", http.port, http.scheme)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, door.tenants.reload)  # the keys file again
    await stop.wait()
    log.info("draining for up to %.0f s", drain_timeout_s)
    await set_not_serving(health, names)
    await asyncio.gather(server.stop(grace=drain_timeout_s),
                         http.stop(drain_timeout_s) if http is not None else asyncio.sleep(0))  # fmt: skip
    await router.close()


if __name__ == "__main__":
    main()
    exit_stopped_process()
