"""``python -m prefill_service [--port 50071] [--redis-url URL] [--threads N] [security flags] [engine options]
[--config FILE]``

Every flag is also the environment variable ``KVSERVE_<FLAG>`` (``--max-wait-ms``: ``KVSERVE_MAX_WAIT_MS``)
and a key of the ``--config`` file's ``prefill`` section (engine options: of its top level too); a flag wins
over its variable, which wins over the file (``prefill_service.settings``, ``rpc.settings``,
``engine.config_file``).
"""

from __future__ import annotations

import logging

from engine import LLMEngine
from prefill_service.settings import PrefillSettings
from prefill_service.worker import PrefillWorker
from rpc.compute_lease import ComputeLease
from rpc.loop import AsyncioThread
from rpc.process import prepare_worker, serve
from rpc.server import exit_stopped_process
from rpc.settings import parse_settings
from rpc.worker_options import WORKER_SET_FIELDS


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(PrefillSettings, argv, "python -m prefill_service", __doc__, WORKER_SET_FIELDS,
                              "prefill")  # fmt: skip
    worker_id, security, registry = prepare_worker(settings, "prefill")
    # A prefill worker's requests end after their first token: it never runs a decode step, so capturing
    # decode CUDA graphs would only cost start-up time and GPU memory.
    engine = LLMEngine(settings.engine_config(enforce_eager=True, compile_decode=False))
    worker = PrefillWorker(engine, worker_id, settings.address, security, settings.max_batch_tokens,
                           settings.max_wait_ms, registry, ComputeLease(settings.compute_lease, "prefill"))  # fmt: skip
    if registry is not None and (ended := registry.end_leases_of(worker_id)):
        logging.info("ended %d leases a previous %s left pending", ended, worker_id)  # it died mid-transfer
    logging.info("prefill worker %s serving on %s", worker_id, worker.address)
    serve(worker, {"Prefill": worker}, AsyncioThread(), security, settings, registry, [engine.close])


if __name__ == "__main__":
    main()
    exit_stopped_process()
