"""The option groups the three services share, each one settings model composed into the process models
(``rpc.worker_options``, ``router.settings``, ``kvserve.settings``); ``rpc.settings`` makes their flags,
``KVSERVE_*`` variables and ``--help``. No engine import here: ``kvserve.healthcheck`` reads
``SecuritySettings`` every few seconds in a container and must start fast.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from rpc.settings import Settings, env_name
from transfer.backend import nixl_installed


def _nixl_installed(transport: str | None) -> str | None:
    if transport == "nixl":
        if not nixl_installed():
            raise ValueError("nixl needs NIXL, which is not installed here (pip install 'kvserve[nixl]')")
    return transport


# ``--kv-transport`` of the decode worker and of ``kvserve up``: a transport to force for every hand-off
KVTransportChoice = Annotated[Literal["shm", "cuda_ipc", "nixl", "grpc"] | None, AfterValidator(_nixl_installed)]


# ``kvserve bench disagg`` on a 2-core CPU host, one user, cold prompts: the hand-off's fixed cost (a lease, a
# Prefill call, the copy and two checksums: 30-120 ms here) made TTFT through a prefill worker 1.67x the decode
# worker's own at 8 tokens, 1.34x at 32, 1.17x at 128, 1.04-1.09x at 256 (two runs), and 1.03-1.14x from 512
# to 2,048 tokens. Below 512 uncached tokens a prompt is prefilled where it decodes (its TTFT then 0.99-1.04x
# decode-only's); from 512 on it is handed off, so that long prefills stay off the decode worker's steps, which
# is what disaggregation is for where each role has a device of its own.
DISAGG_MIN_UNCACHED_TOKENS = 512


class DisaggSettings(Settings):
    """disaggregation: which prompts a decode worker hands to a prefill worker (decode_service.disaggregation)"""

    disagg_min_uncached_tokens: int = Field(
        DISAGG_MIN_UNCACHED_TOKENS,
        ge=0,
        description="a prompt with fewer tokens outside the decode worker's cache is prefilled there, not handed "
        "off (0: every prompt goes to a prefill worker while one is live)",
    )
    disagg_max_prefill_queue: int = Field(
        8,
        ge=0,
        description="a prompt is prefilled on the decode worker when the least-loaded prefill worker has more "
        "requests than this queued or running and the decode worker is prefilling nothing (0: no bound)",
    )


class DrainSettings(Settings):
    """stopping"""

    drain_timeout: float = Field(30.0, ge=0, description="seconds SIGTERM lets running requests and streams finish")


class ServeSettings(DrainSettings):
    """serving: where this process listens"""

    host: str = Field("127.0.0.1", description="the address to listen on")
    port: int = Field(0, ge=0, le=65535, description="the gRPC port")


class TracingSettings(Settings):
    """tracing: OpenTelemetry (see rpc/tracing.py)"""

    otlp_traces_endpoint: str | None = Field(
        None,
        description="send this process's spans over OTLP/gRPC to this collector (http://HOST:4317; https:// for "
        "TLS); none: no tracing, at no cost",
    )
    trace_sample_ratio: float = Field(
        1.0, ge=0, le=1, description="the share of requests traced when the client sent no traceparent"
    )


class RegistrySettings(Settings):
    """registry"""

    redis_url: str | None = Field(
        None,
        description="the registry: redis://, rediss:// (TLS) or unix://, with user and password; pass a password "
        "in the environment variable, since every local user can read a command line (kvserve up without one: "
        "an embedded Redis only its cluster can use)",
    )


# The registry's URL, which may hold a password: a process's environment is private to its user, while its
# command line is not (``ps``, /proc/PID/cmdline), so ``kvserve up`` hands it to its children here.
REDIS_URL_ENV = env_name(RegistrySettings, "redis_url")


class SecuritySettings(Settings):
    """security: who may call whom (see security/auth.py)"""

    cluster_token_file: str | None = Field(
        None,
        description="file holding the cluster token or this process's credential (else $KVSERVE_CLUSTER_TOKEN)",
    )
    cluster_certs: str | None = Field(
        None,
        description="this process's cluster certificate: DIR/cert.pem, key.pem (mode 600) and the cluster CA's "
        "ca.pem (kvserve certs makes them); internal gRPC then runs over mutual TLS, authorized by role",
    )
    insecure_internal: bool = Field(False, description="serve internal RPCs without the cluster token (logs a warning)")
    tls_cert: str | None = Field(
        None,
        description="PEM certificate of the router's public port (of this process's port, without --cluster-certs)",
    )
    tls_key: str | None = Field(None, description="PEM private key of --tls-cert")
    tls_ca: str | None = Field(None, description="PEM CA: verify peers with it and require client certificates")


class ThreadSettings(Settings):
    """compute threads"""

    threads: int | None = Field(
        None, ge=1, description="torch threads per compute worker; none: this host's cores / its compute workers "
        "(all of them with --compute-lease)"
    )
    compute_lease: str | None = Field(
        None,
        description="a file path the compute workers sharing this host's cores all name: each engine step holds "
        "it, so one worker computes at a time, on all the cores (rpc.compute_lease); kvserve up sets it on a CPU "
        "host when --threads is not given",
    )
