"""The decode worker's options (``python -m decode_service --help``): the workers' shared groups
(``rpc.options.WorkerSettings``, the engine's included) and its own."""

from __future__ import annotations

from pydantic import Field

from rpc.options import DisaggSettings, KVTransportChoice
from rpc.worker_options import WorkerSettings


class DecodeSettings(WorkerSettings, DisaggSettings):
    """decode worker"""

    port: int = Field(50061, ge=0, le=65535, description="the gRPC port")
    max_waiting: int = Field(64, ge=0, description="requests queued for KV blocks before RESOURCE_EXHAUSTED")
    prefill_timeout_s: float = Field(30.0, gt=0, description="a prefill's base deadline")
    prefill_ms_per_token: float = Field(20.0, ge=0, description="added to it per prompt token")
    kv_transport: KVTransportChoice = Field(
        None,
        description="force one KV transport for every hand-off (default: shm or cuda_ipc on one host, else nixl "
        "when both workers offer it, else grpc); nixl starts this worker's NIXL agent at start-up",
    )
    no_shm: bool = Field(False, description="keep the KV pool in private memory")
    prefill_reads_cached_prefix: bool = Field(
        True,
        description="a prefill worker that maps our pool (shm, cuda_ipc) reads our cached prefix blocks in place "
        "instead of recomputing that prefix",
    )
