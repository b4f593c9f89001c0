"""What both worker roles take: the shared groups (``rpc.options``), the engine's options and a worker's
identity; ``decode_service.settings`` and ``prefill_service.settings`` add each role's own."""

from __future__ import annotations

from pydantic import Field

from engine.config import EngineConfig
from rpc.options import RegistrySettings, SecuritySettings, ServeSettings, ThreadSettings, TracingSettings


class WorkerSettings(ServeSettings, RegistrySettings, ThreadSettings, SecuritySettings, TracingSettings, EngineConfig):
    """worker: what both worker roles take"""

    worker_id: str | None = Field(None, description="this worker's name; none: its certificate's, else a random one")
    advertise: str | None = Field(None, description="host:port peers should dial; none: --host:--port")
    metrics_port: int = Field(
        0, ge=0, le=65535, description="HTTP port of this worker's Prometheus /metrics (0: any free port, logged)"
    )

    def engine_config(self, **update: object) -> EngineConfig:
        """The engine's part of these settings (already validated: no second read of the environment)."""
        return EngineConfig.model_validate(self.model_dump(include=set(EngineConfig.model_fields)) | update)

    @property
    def address(self) -> str:
        return self.advertise or f"{self.host}:{self.port}"


# Engine fields a worker sets itself rather than taking as flags: its pool's shared-memory name (a decode
# worker's id, or none with --no-shm; a prefill worker keeps its pool private).
WORKER_SET_FIELDS = ("shared_kv_name",)
