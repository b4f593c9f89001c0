"""``python -m router --port 50051 [--http-port 8000] [--redis-url URL] [--decode-address HOST:PORT ...]``

Serves ``kvserve.v1.Inference``, health checking and reflection on one port, and the OpenAI-compatible HTTP
API (``router.openai_api``) on ``--http-port`` (0: none), both on one event loop and both with TLS when
``--tls-cert`` is given, and both behind the front door (``router.limits``: API key, request size,
concurrency). Prometheus ``/metrics`` is on the HTTP port, or on ``--metrics-port`` when given. The router
calls the decode workers' internal service as a member of role ``router`` (``rpc.auth``): with its cluster
certificate (``--cluster-certs``) over mutual TLS, else with its credential's call token; ``--tls-*`` serve
its public port only (and its calls too, without ``--cluster-certs``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from typing import TYPE_CHECKING

from engine.bundled import resolve_model
from engine.config import ModelConfig
from engine.tokenizer import Tokenizer
from kvstore.registry import Registry
from router.limits import FrontDoor, PublicInference, add_front_door_args, front_door_from_args
from router.routing import RoutingWeights
from router.server import Router
from router.validation_queue import DEFAULT_MAX_BACKLOG
from rpc.auth import Security, add_security_args, security_from_args, tls_files
from rpc.flags import add_redis_url_arg, boolean_flag
from rpc.metrics import start_metrics_server
from rpc.server import add_service, new_server, set_not_serving, start_server

if TYPE_CHECKING:
    from router.openai_api import HttpServer

log = logging.getLogger("router")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m router", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--http-port", type=int, default=8000, help="the OpenAI-compatible HTTP API's port; 0: none")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve Prometheus /metrics on this port instead of the HTTP API's (0: there)")  # fmt: skip
    parser.add_argument("--model", default="default")
    parser.add_argument("--skip-tokenizer-init", type=boolean_flag, default=False,
                        help="load no tokenizer (a model without one): prompts must be token ids")  # fmt: skip
    add_redis_url_arg(parser)
    parser.add_argument("--decode-address", action="append", default=[], help="static decode workers (no Redis)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds SIGTERM lets open streams finish")  # fmt: skip
    parser.add_argument("--migrate-streams", type=boolean_flag, default=True,
                        help="continue a stream on another decode worker when its own dies or drains mid-stream "
                             "(true|false)")  # fmt: skip
    parser.add_argument("--stream-idle-timeout", type=float, default=30.0,
                        help="seconds a streaming client may read nothing before its stream is cancelled (and its "
                             "KV blocks freed); 0: no limit")  # fmt: skip
    routing = parser.add_argument_group("cache-aware routing (see router/routing.py)")
    routing.add_argument("--route-block-weight", type=float, default=RoutingWeights.block_weight,
                         help="cost of one prompt block a worker would compute or receive")
    routing.add_argument("--route-load-weight", type=float, default=RoutingWeights.load_weight,
                         help="cost of one request a worker runs or queues")
    routing.add_argument("--route-balance-threshold", type=int, default=RoutingWeights.balance_threshold,
                         help="requests of imbalance past which load alone decides")
    add_front_door_args(parser)
    parser.add_argument("--max-validation-backlog", type=int, default=DEFAULT_MAX_BACKLOG,
                        help="prompt characters that may wait for the validation thread, past which new "
                             "requests get RESOURCE_EXHAUSTED / 429 (see router/validation_queue.py)")  # fmt: skip
    add_security_args(parser)
    args, _ = parser.parse_known_args(argv)  # engine flags meant for workers are accepted and ignored
    logging.basicConfig(level=logging.INFO, format="%(asctime)s router %(levelname)s %(message)s")
    try:
        security = security_from_args(args, "router")
        public = Security(None, **tls_files(args))
        door = front_door_from_args(args)
    except ValueError as err:
        parser.error(str(err))
    path = resolve_model(args.model)
    config = ModelConfig.from_dir(path)
    registry = Registry(args.redis_url, security=security) if args.redis_url else None
    try:
        weights = RoutingWeights(args.route_block_weight, args.route_load_weight, args.route_balance_threshold)
    except ValueError as err:
        parser.error(str(err))
    tokenizer = None if args.skip_tokenizer_init else Tokenizer(path)
    try:
        router = Router(tokenizer, config.vocab_size, config.max_context, security, registry, args.decode_address,
                        weights=weights, migrate_streams=args.migrate_streams,
                        stream_idle_timeout_s=args.stream_idle_timeout,
                        max_validation_backlog=args.max_validation_backlog)  # fmt: skip
    except ValueError as err:
        parser.error(str(err))
    http = None
    if args.http_port:
        from router.openai_api import HttpServer, create_app  # fastapi and uvicorn: only for the HTTP API

        app = create_app(router, path.name, door, serve_metrics=not args.metrics_port)
        try:
            http = HttpServer(app, args.host, args.http_port, args.tls_cert, args.tls_key, args.tls_ca)
        except OSError as err:
            parser.error(f"cannot listen on {args.host}:{args.http_port} for HTTP: {err.strerror}")
    if args.metrics_port:
        try:
            start_metrics_server(args.host, args.metrics_port)
        except OSError as err:
            parser.error(f"cannot listen on {args.host}:{args.metrics_port} for /metrics: {err.strerror}")
        log.info("serving Prometheus /metrics on %s:%d", args.host, args.metrics_port)
    try:
        asyncio.run(serve(router, f"{args.host}:{args.port}", public, args.drain_timeout, http, door))
    finally:
        if registry is not None:
            registry.stop()


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
    await stop.wait()
    log.info("draining for up to %.0f s", drain_timeout_s)
    await set_not_serving(health, names)
    await asyncio.gather(server.stop(grace=drain_timeout_s),
                         http.stop(drain_timeout_s) if http is not None else asyncio.sleep(0))  # fmt: skip
    await router.close()


if __name__ == "__main__":
    main()
