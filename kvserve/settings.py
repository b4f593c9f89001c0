"""``kvserve up``: start a local cluster (Redis, prefill and decode workers, a router; see kvserve/launcher/cluster.py),
then supervise it until Ctrl-C or SIGTERM.

Every flag is also the environment variable KVSERVE_<FLAG> (the flag wins). The launcher passes the options
it shares with its children on by walking their models (``rpc.settings.settings_argv``), not a list of flags:

* every engine option given (flag or ``KVSERVE_*``) goes to every worker, but ``UP_SET_FIELDS``: each
  worker's share of the GPU comes from ``--prefill/decode-gpu-memory-utilization``, its tensor-parallel size
  from ``--prefill-tp``/``--decode-tp``, and a worker names its own shared-memory pool;
* the router gets the model's options (``ModelSettings``), ``--max-model-len``, the served names
  (``ServedModelSettings``) and the stream options (``StreamSettings``);
* the decode workers get ``--kv-transport``;
* security: ``--insecure-internal`` every child, ``--tls-*`` the router only (``security.cluster_tls``); the
  token and the API key go through the environment, never a command line;
* ``--config FILE`` (``engine.config_file``): kvserve up reads its top level and its ``up`` section, and
  passes the file itself on to every child, which reads the top level and its own section. So what kvserve up
  took from the file's top level is not passed on as a flag (a child's section may override it there); what
  it took from its ``up`` section is, as if typed on its command line.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pydantic import Field

from engine.config import EngineConfig
from router.settings import ApiKeySettings, ServedModelSettings, StreamSettings
from rpc.options import (
    DisaggSettings,
    DrainSettings,
    KVTransportChoice,
    RegistrySettings,
    SecuritySettings,
    ThreadSettings,
    TracingSettings,
)
from rpc.settings import fields_of, parse_settings, settings_argv

UP_SET_FIELDS = ("gpu_memory_utilization", "shared_kv_name", "tensor_parallel_size")


class UpSettings(ThreadSettings, RegistrySettings, DrainSettings, StreamSettings, ServedModelSettings, ApiKeySettings,
                 SecuritySettings, TracingSettings, DisaggSettings, EngineConfig):  # fmt: skip
    """cluster: what kvserve up starts (the options above go to its processes)"""

    prefill: int = Field(1, ge=0, description="number of prefill workers")
    decode: int = Field(1, ge=0, description="number of decode workers")
    routers: int = Field(
        1,
        ge=1,
        description="number of routers, replicas over the same workers and Redis: router i > 0 listens on port + "
        "50 + i and http_port + i (kvserve.Client given them all fails over between them)",
    )
    port: int = Field(50051, ge=1, le=65535, description="the router's port (workers use the next ports)")
    http_port: int = Field(8000, ge=0, le=65535, description="the router's OpenAI-compatible HTTP API; 0: none")
    redis_tcp: bool = Field(
        False,
        description="the embedded Redis (no --redis-url) also listens on a TCP port of 127.0.0.1 (still with its "
        "password)",
    )
    log_dir: str | None = Field(None, description="one <name>.log per process; none: the launcher's stderr")
    prefill_gpu_memory_utilization: float = Field(
        0.35,
        gt=0,
        le=1,
        description="fraction of the GPU's total memory the prefill workers use together (weights included; split "
        "evenly; passed to each as its --gpu-memory-utilization)",
    )
    decode_gpu_memory_utilization: float = Field(
        0.5,
        gt=0,
        le=1,
        description="the same for the decode workers; both roles share the one GPU, so the two add up to at most 1",
    )
    internal_tls: bool = Field(
        True,
        description="internal gRPC over mutual TLS with certificates of a cluster CA made at each start (false: "
        "the cluster token alone)",
    )

    prefill_tp: int = Field(1, ge=1, description="tensor_parallel_size of each prefill worker (its ranks)")
    decode_tp: int = Field(1, ge=1, description="tensor_parallel_size of each decode worker (its ranks)")

    def role_tp(self, role: str) -> int:
        """The tensor-parallel size of ``role``'s workers."""
        return getattr(self, f"{role}_tp")

    kv_transport: KVTransportChoice = Field(
        None,
        description="force one KV transport for every hand-off, passed to each decode worker (default: shm or "
        "cuda_ipc on one host, else nixl when both workers offer it, else grpc)",
    )

    def decode_argv(self) -> list[str]:
        """The decode workers' own flags given to ``kvserve up``: ``--kv-transport`` and the ``--disagg-*``."""
        transport = ["--kv-transport", self.kv_transport] if self.kv_transport else []
        return [*transport, *settings_argv(self, fields_of(DisaggSettings))]

    def tracing_argv(self) -> list[str]:
        """``--otlp-traces-endpoint`` and ``--trace-sample-ratio`` as given, for every process."""
        return settings_argv(self, fields_of(TracingSettings))

    def engine_argv(self) -> list[str]:
        """The engine options given to ``kvserve up``, as every worker's flags; with ``--api-keys-file`` and no
        ``--scheduling-policy``, ``priority``: the workers then run requests within their tenant's share first
        (``router.fair_queue``)."""
        argv = settings_argv(self, fields_of(EngineConfig, UP_SET_FIELDS))
        if self.api_keys_file and "scheduling_policy" not in self.model_fields_set:
            argv += ["--scheduling-policy", "priority"]
        return argv

    def router_argv(self) -> list[str]:
        """The stream options, the served names and ``--max-model-len`` given, as the router's flags (its model
        options come from ``ModelSettings``); with ``--api-keys-file`` (absolute) its fair queue's slots, by
        default the decode workers' running slots in all (``max_num_seqs`` each)."""
        argv = settings_argv(self, [*fields_of(StreamSettings), *fields_of(ServedModelSettings), "max_model_len"])
        if not self.api_keys_file:
            return argv
        slots = self.fair_queue_slots or self.decode * self.max_num_seqs
        return [*argv, "--api-keys-file", str(Path(self.api_keys_file).absolute()), "--fair-queue-slots", str(slots)]

    def security_argv(self) -> list[str]:
        """``--insecure-internal`` and ``--tls-*`` (absolute: ``security.cluster_tls`` reads them too) as given."""
        paths = {name: str(Path(path).absolute()) for name in ("tls_cert", "tls_key", "tls_ca")
                 if (path := getattr(self, name))}  # fmt: skip
        passed = fields_of(SecuritySettings, ("cluster_token_file", "cluster_certs"))  # environment; made by up
        return settings_argv(self.model_copy(update=paths), passed)


def parse_up(argv: Sequence[str]) -> UpSettings:
    """``kvserve up``'s settings from its flags, its ``KVSERVE_*`` variables, its ``--config`` file and the
    defaults; a flag it does not know, or a key of the file, ends the program as it ends ``kvserve up`` (status
    2). The CLI reads its command line so, and so does a program that starts a cluster itself
    (``kvserve.launcher.cluster.start_cluster``)."""
    return parse_settings(UpSettings, list(argv), "kvserve up", __doc__, UP_SET_FIELDS, "up")
