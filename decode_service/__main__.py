"""``python -m decode_service [--port 50061] [--redis-url URL] [--threads N] [security flags] [engine options]
[--config FILE]``

Every flag is also the environment variable ``KVSERVE_<FLAG>`` (``--max-waiting``: ``KVSERVE_MAX_WAITING``)
and a key of the ``--config`` file's ``decode`` section (engine options: of its top level too); a flag wins
over its variable, which wins over the file (``decode_service.settings``, ``rpc.settings``,
``engine.config_file``).
"""

from __future__ import annotations

import logging

from decode_service.disaggregation import DisaggPolicy
from decode_service.settings import DecodeSettings
from engine import LLMEngine
from rpc.compute_lease import ComputeLease
from rpc.loop import AsyncioThread
from rpc.process import prepare_worker, serve
from rpc.server import exit_stopped_process
from rpc.settings import parse_settings
from rpc.worker_options import WORKER_SET_FIELDS


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(DecodeSettings, argv, "python -m decode_service", __doc__, WORKER_SET_FIELDS, "decode")
    worker_id, security, registry = prepare_worker(settings, "decode")
    # (under tensor parallelism every rank's part of the pool is a file of its own beside ours)
    engine = LLMEngine(settings.engine_config(shared_kv_name=None if settings.no_shm else worker_id))
    aio = AsyncioThread()
    from decode_service.worker import DecodeWorker

    worker = DecodeWorker(engine, worker_id, settings.address, aio, security, registry,
                          shm_path=str(engine.runner.kv_pool_path or ""), max_waiting=settings.max_waiting,
                          prefill_timeout_s=settings.prefill_timeout_s,
                          prefill_ms_per_token=settings.prefill_ms_per_token, kv_transport=settings.kv_transport,
                          prefill_reads_cached_prefix=settings.prefill_reads_cached_prefix,
                          compute=ComputeLease(settings.compute_lease, "decode"),
                          disagg=DisaggPolicy(settings.disagg_min_uncached_tokens,
                                              settings.disagg_max_prefill_queue))  # fmt: skip
    logging.info("decode worker %s serving on %s (KV pool: %s)", worker_id, worker.address,
                 engine.runner.kv_pool_path or "private")  # fmt: skip
    serve(worker, {"Decode": worker, "KVTransfer": worker.receiver}, aio, security, settings, registry,
          [engine.close])  # fmt: skip


if __name__ == "__main__":
    main()
    exit_stopped_process()
