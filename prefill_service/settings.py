"""The prefill worker's options (``python -m prefill_service --help``): the workers' shared groups
(``rpc.options.WorkerSettings``, the engine's included) and its own."""

from __future__ import annotations

from pydantic import Field

from rpc.worker_options import WorkerSettings


class PrefillSettings(WorkerSettings):
    """prefill worker: its dynamic batcher"""

    port: int = Field(50071, ge=0, le=65535, description="the gRPC port")
    max_batch_tokens: int = Field(4096, ge=1, description="prompt tokens in one prefill batch")
    max_wait_ms: float = Field(20.0, ge=0, description="how long a batch waits for more prompts")
