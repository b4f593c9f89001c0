"""``python -m decode_service --port 50061 [--redis-url URL] [engine options]``"""

from __future__ import annotations

import argparse
import logging
import uuid

from engine import LLMEngine
from kvserve.serving import add_engine_args, engine_config_from_args, new_server, serve_until_signal, start_server
from kvstore.registry import Registry
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m decode_service", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50061)
    parser.add_argument("--worker-id", default=None)
    parser.add_argument("--advertise", default=None, help="host:port peers should dial (default: --host:--port)")
    parser.add_argument("--redis-url", default=None, help="registry; without it every prefill is local")
    parser.add_argument("--max-waiting", type=int, default=64)
    parser.add_argument("--prefill-timeout-s", type=float, default=30.0)
    parser.add_argument("--transfer-backend", choices=["shm", "grpc"], default=None, help="force one backend")
    parser.add_argument("--no-shm", action="store_true", help="keep the KV pool in private memory")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s decode %(levelname)s %(message)s")
    worker_id = args.worker_id or f"decode-{uuid.uuid4().hex[:8]}"

    config = engine_config_from_args(args)
    engine = LLMEngine(config.model_copy(update={"shared_kv_name": None if args.no_shm else worker_id}))
    server = new_server()
    address = args.advertise or f"{args.host}:{args.port}"
    registry = Registry(args.redis_url) if args.redis_url else None
    from decode_service.worker import DecodeWorker

    worker = DecodeWorker(engine, worker_id, address, registry, shm_path=str(engine.runner.kv_pool_path or ""),
                          max_waiting=args.max_waiting, prefill_timeout_s=args.prefill_timeout_s,
                          force_backend=args.transfer_backend)  # fmt: skip
    pb_grpc.add_DecodeServicer_to_server(worker, server)
    pb_grpc.add_KVTransferServicer_to_server(worker.receiver, server)
    port, _ = start_server(server, ["kvserve.v1.Decode", "kvserve.v1.KVTransfer"], f"{args.host}:{args.port}")
    if registry is not None:
        registry.register(worker.info())
        registry.start_heartbeat(worker.load)
    logging.info(
        "decode worker %s serving on %s (KV pool: %s)", worker_id, address, engine.runner.kv_pool_path or "private"
    )
    serve_until_signal(server, [worker.stop, *([registry.stop] if registry else []), engine.close], worker.loop)


if __name__ == "__main__":
    main()
