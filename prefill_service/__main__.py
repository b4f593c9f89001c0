"""``python -m prefill_service --port 50071 [--redis-url URL] [engine options]``"""

from __future__ import annotations

import argparse
import logging
import uuid

from engine import LLMEngine
from kvserve.serving import add_engine_args, engine_config_from_args, new_server, serve_until_signal, start_server
from kvstore.registry import Registry
from kvstore.workers import WorkerInfo, local_host_id
from prefill_service.worker import PrefillWorker
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m prefill_service", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50071)
    parser.add_argument("--worker-id", default=None)
    parser.add_argument("--advertise", default=None, help="host:port peers should dial (default: --host:--port)")
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--max-batch-tokens", type=int, default=4096)
    parser.add_argument("--max-wait-ms", type=float, default=20.0)
    add_engine_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s prefill %(levelname)s %(message)s")
    worker_id = args.worker_id or f"prefill-{uuid.uuid4().hex[:8]}"
    engine = LLMEngine(engine_config_from_args(args))
    worker = PrefillWorker(engine, worker_id, args.max_batch_tokens, args.max_wait_ms)
    server = new_server()
    address = args.advertise or f"{args.host}:{args.port}"
    pb_grpc.add_PrefillServicer_to_server(worker, server)
    start_server(server, ["kvserve.v1.Prefill"], f"{args.host}:{args.port}")
    registry = None
    if args.redis_url:
        registry = Registry(args.redis_url)
        registry.register(WorkerInfo(worker_id=worker_id, role="prefill", address=address, host_id=local_host_id(),
                                     device=str(engine.runner.device), fingerprint=worker.fingerprint,
                                     **worker.load()))  # fmt: skip
        registry.start_heartbeat(worker.load)
    logging.info("prefill worker %s serving on %s", worker_id, address)
    serve_until_signal(server, [worker.stop, *([registry.stop] if registry else []), engine.close], worker.loop)


if __name__ == "__main__":
    main()
