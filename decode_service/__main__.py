"""``python -m decode_service --port 50061 [--redis-url URL] [--threads N] [security flags] [engine options]``"""

from __future__ import annotations

import argparse
import logging

from engine import LLMEngine
from rpc.flags import add_worker_args, boolean_flag, engine_config_from_args
from rpc.loop import AsyncioThread
from rpc.process import prepare_worker, serve


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m decode_service", description=__doc__)
    add_worker_args(parser, default_port=50061)
    parser.add_argument("--max-waiting", type=int, default=64, help="requests queued for KV blocks before "
                        "RESOURCE_EXHAUSTED")  # fmt: skip
    parser.add_argument("--prefill-timeout-s", type=float, default=30.0, help="a prefill's base deadline")
    parser.add_argument("--prefill-ms-per-token", type=float, default=20.0, help="added to it per prompt token")
    parser.add_argument("--transfer-backend", choices=["shm", "grpc"], default=None, help="force one backend")
    parser.add_argument("--no-shm", action="store_true", help="keep the KV pool in private memory")
    parser.add_argument("--prefill-reads-cached-prefix", type=boolean_flag, default=True,
                        help="true|false: a prefill worker that maps our pool (shm, cuda_ipc) reads our cached "
                        "prefix blocks in place instead of recomputing that prefix")  # fmt: skip
    args = parser.parse_args(argv)
    worker_id, security, registry = prepare_worker(args, "decode")
    engine = LLMEngine(engine_config_from_args(args).model_copy(
        update={"shared_kv_name": None if args.no_shm else worker_id}))  # fmt: skip
    aio = AsyncioThread()
    from decode_service.worker import DecodeWorker

    worker = DecodeWorker(engine, worker_id, args.advertise or f"{args.host}:{args.port}", aio, security, registry,
                          shm_path=str(engine.runner.kv_pool_path or ""), max_waiting=args.max_waiting,
                          prefill_timeout_s=args.prefill_timeout_s, prefill_ms_per_token=args.prefill_ms_per_token,
                          force_backend=args.transfer_backend,
                          prefill_reads_cached_prefix=args.prefill_reads_cached_prefix)  # fmt: skip
    logging.info("decode worker %s serving on %s (KV pool: %s)", worker_id, worker.address,
                 engine.runner.kv_pool_path or "private")  # fmt: skip
    serve(worker, {"Decode": worker, "KVTransfer": worker.receiver}, aio, security, args, registry, [engine.close])


if __name__ == "__main__":
    main()
