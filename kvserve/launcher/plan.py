"""What ``kvserve up`` starts, worked out before anything starts: ``plan_cluster(up)`` gives each child's name,
role, ports and command line and the start order, and checks what can be checked without a process (GPU shares,
``--redis-tcp`` with ``--redis-url``); ``kvserve.launcher.cluster.launch`` then runs the plan.

Ports: the router listens on ``up.port`` (gRPC) and ``up.http_port`` (the OpenAI-compatible API; 0: none), decode
worker *i* on ``port + 10 + i``, prefill worker *i* on ``port + 30 + i``, each worker's ``/metrics`` on its port
+ 1000. Compute workers get ``--threads``, their share of the host's cores, so they do not preempt each other,
and ``--gpu-memory-utilization``, their share of the GPU's total memory, since every worker runs on the same GPU
(``gpu_memory_shares``; ignored on the CPU). What the options of ``UpSettings`` become for each child is
``kvserve.settings``'s docstring.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from engine.config import ModelSettings
from kvserve.settings import UpSettings
from rpc.settings import fields_of, settings_argv
from rpc.threads import host_cores
from security.cluster_tls import split_public_tls

DECODE_PORTS, PREFILL_PORTS, METRICS_PORTS = 10, 30, 1000  # offsets from the router's port, and a worker's


@dataclass(frozen=True)
class ExtraArgv:
    """Flags for one role's processes beyond what ``UpSettings`` says (tests and benchmarks: a decode worker's
    ``--prefill-timeout-s``, a prefill worker's ``--max-wait-ms``); they come last, so they win."""

    decode: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()
    router: tuple[str, ...] = ()


@dataclass(frozen=True)
class ChildPlan:
    name: str  # "decode-0", "prefill-0", "router"
    role: str  # "decode", "prefill" or "router"
    port: int
    argv: tuple[str, ...]  # its command line, less the credential flags ``launch`` adds
    metrics_port: int  # a worker's /metrics; the router serves its own on the HTTP port (0: none)


@dataclass(frozen=True)
class ClusterPlan:
    up: UpSettings
    host: str
    children: tuple[ChildPlan, ...]  # in start order: the decode workers, the prefill workers, the router
    public_argv: tuple[str, ...]  # the router's --tls-* flags, which serve its public port only

    @property
    def ports(self) -> list[int]:
        """Every port the children will listen on: checked free before anything starts."""
        workers = [c for c in self.children if c.role != "router"]
        return [self.up.port, *([self.up.http_port] if self.up.http_port else []), *(c.port for c in workers),
                *(c.metrics_port for c in workers)]  # fmt: skip

    @property
    def worker_ids(self) -> set[str]:
        return {c.name for c in self.children if c.role != "router"}

    @property
    def http_endpoint(self) -> str | None:
        """The router's OpenAI-compatible API, ``http(s)://HOST:PORT``; None without one."""
        scheme = "https" if self.public_argv else "http"
        return f"{scheme}://{self.host}:{self.up.http_port}" if self.up.http_port else None


def plan_cluster(up: UpSettings, extra: ExtraArgv | None = None, host: str = "127.0.0.1") -> ClusterPlan:
    """The plan of ``up``'s cluster on ``host``; ``ValueError`` for options that cannot work together."""
    extra = extra or ExtraArgv()
    if up.redis_tcp and up.redis_url:
        raise ValueError("--redis-tcp is for the embedded Redis, and --redis-url (or $KVSERVE_REDIS_URL) names another")
    shares = gpu_memory_shares(up.prefill_gpu_memory_utilization, up.decode_gpu_memory_utilization, up.prefill,
                               up.decode)  # fmt: skip
    shared_argv, public_argv = split_public_tls(up.security_argv())
    worker_argv = ["--threads", str(threads_per_worker(up.prefill + up.decode, up.threads)),
                   "--drain-timeout", str(up.drain_timeout), *shared_argv, *up.tracing_argv(),
                   *up.engine_argv()]  # fmt: skip
    children = []
    for role, count, offset, role_argv in (("decode", up.decode, DECODE_PORTS, [*up.decode_argv(), *extra.decode]),
                                           ("prefill", up.prefill, PREFILL_PORTS, extra.prefill)):  # fmt: skip
        for i in range(count):
            port, name = up.port + offset + i, f"{role}-{i}"
            argv = (sys.executable, "-m", f"{role}_service", "--host", host, "--port", str(port), "--worker-id", name,
                    "--metrics-port", str(port + METRICS_PORTS), *worker_argv, "--gpu-memory-utilization",
                    str(shares[role]), *role_argv)  # fmt: skip
            children.append(ChildPlan(name, role, port, argv, port + METRICS_PORTS))
    router = (sys.executable, "-m", "router", "--host", host, "--port", str(up.port), "--http-port", str(up.http_port),
              "--drain-timeout", str(up.drain_timeout), *settings_argv(up, fields_of(ModelSettings)), *shared_argv,
              *public_argv, *up.tracing_argv(), *up.router_argv(), *extra.router)  # fmt: skip
    children.append(ChildPlan("router", "router", up.port, router, up.http_port))
    return ClusterPlan(up, host, tuple(children), tuple(public_argv))


def threads_per_worker(num_compute_workers: int, threads: int | None = None) -> int:
    """Torch threads per compute worker: ``threads``, else an equal share of the host's cores."""
    return threads or max(1, host_cores() // max(1, num_compute_workers))


def gpu_memory_shares(prefill: float, decode: float, num_prefill: int, num_decode: int) -> dict[str, float]:
    """Each worker's ``--gpu-memory-utilization`` by role, when the whole cluster shares one GPU: ``prefill``
    and ``decode`` are the fractions of the GPU's total memory each role's workers may use together, split
    evenly between them. Raises ``ValueError`` when the roles together ask for more than the GPU."""
    for role, share in (("prefill", prefill), ("decode", decode)):
        if not 0 < share <= 1:
            raise ValueError(f"{role} GPU memory utilization must be in (0, 1], got {share}")
    if prefill + decode > 1:
        raise ValueError(f"prefill ({prefill}) and decode ({decode}) GPU memory utilizations add up to more than "
                         "the whole GPU, which their workers share")  # fmt: skip
    return {"prefill": prefill / max(1, num_prefill), "decode": decode / max(1, num_decode)}
