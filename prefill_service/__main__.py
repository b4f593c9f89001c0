"""``python -m prefill_service --port 50071 [--redis-url URL] [--threads N] [security flags] [engine options]``"""

from __future__ import annotations

import argparse
import logging
import sys
import uuid

from engine import LLMEngine
from kvstore.registry import Registry
from prefill_service.worker import PrefillWorker
from rpc.auth import security_from_args
from rpc.flags import add_worker_args, engine_config_from_args
from rpc.loop import AsyncioThread
from rpc.process import compute_threads, serve


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m prefill_service", description=__doc__)
    add_worker_args(parser, default_port=50071)
    parser.add_argument("--max-batch-tokens", type=int, default=4096)
    parser.add_argument("--max-wait-ms", type=float, default=20.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s prefill %(levelname)s %(message)s")
    worker_id = args.worker_id or f"prefill-{uuid.uuid4().hex[:8]}"
    try:
        security = security_from_args(args)
    except ValueError as err:
        sys.exit(f"prefill worker: {err}")
    registry = Registry(args.redis_url, security=security) if args.redis_url else None
    compute_threads(args, registry)
    engine = LLMEngine(engine_config_from_args(args))
    worker = PrefillWorker(engine, worker_id, args.advertise or f"{args.host}:{args.port}", security,
                           args.max_batch_tokens, args.max_wait_ms)  # fmt: skip
    logging.info("prefill worker %s serving on %s", worker_id, worker.address)
    serve(worker, {"Prefill": worker}, AsyncioThread(), security, args, registry, [engine.close])


if __name__ == "__main__":
    main()
