"""``python -m prefill_service --port 50071 [--redis-url URL] [--threads N] [security flags] [engine options]``"""

from __future__ import annotations

import argparse
import logging

from engine import LLMEngine
from prefill_service.worker import PrefillWorker
from rpc.flags import add_worker_args, engine_config_from_args
from rpc.loop import AsyncioThread
from rpc.process import prepare_worker, serve


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m prefill_service", description=__doc__)
    add_worker_args(parser, default_port=50071)
    parser.add_argument("--max-batch-tokens", type=int, default=4096)
    parser.add_argument("--max-wait-ms", type=float, default=20.0)
    args = parser.parse_args(argv)
    worker_id, security, registry = prepare_worker(args, "prefill")
    # A prefill worker's requests end after their first token: it never runs a decode step, so capturing
    # decode CUDA graphs would only cost start-up time and GPU memory.
    engine = LLMEngine(engine_config_from_args(args).model_copy(update={"enforce_eager": True}))
    worker = PrefillWorker(engine, worker_id, args.advertise or f"{args.host}:{args.port}", security,
                           args.max_batch_tokens, args.max_wait_ms, registry)  # fmt: skip
    if registry is not None and (ended := registry.end_leases_of(worker_id)):
        logging.info("ended %d leases a previous %s left pending", ended, worker_id)  # it died mid-transfer
    logging.info("prefill worker %s serving on %s", worker_id, worker.address)
    serve(worker, {"Prefill": worker}, AsyncioThread(), security, args, registry, [engine.close])


if __name__ == "__main__":
    main()
