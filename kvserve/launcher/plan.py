"""What ``kvserve up`` starts, worked out before anything starts: ``plan_cluster(up)`` gives each child's name,
role, ports and command line and the start order, and checks what can be checked without a process (GPU shares,
``--redis-tcp`` with ``--redis-url``); ``kvserve.launcher.cluster.launch`` then runs the plan.

Ports: the router listens on ``up.port`` (gRPC) and ``up.http_port`` (the OpenAI-compatible API; 0: none), decode
worker *i* on ``port + 10 + i``, prefill worker *i* on ``port + 30 + i``, each worker's ``/metrics`` on its port
+ 1000. With ``--routers N`` router *i* > 0 (``router-i``, a replica over the same workers and Redis) listens on
``port + 50 + i`` and ``http_port + i``.

Compute workers on a CPU host take turns on all of its cores: each gets ``--threads`` = the host's cores and
the same ``--compute-lease``, held around every engine step (``rpc.compute_lease``), so a worker with
nothing to run holds no core and two busy workers never oversubscribe them. With ``--threads`` given, or on a
GPU host, each gets ``--threads`` (by default its share of the cores) and no lease. Each also gets
``--gpu-memory-utilization``, their share of the GPU's total memory, since every worker runs on the same GPU
(``gpu_memory_shares``; ignored on the CPU), and ``--tensor-parallel-size``, its role's
(``--prefill-tp``/``--decode-tp``: any two sizes hand KV off, through pool files on the CPU and CUDA IPC
handles on a GPU, ``kvstore.split_pool``). On a CPU host decode workers get ``--compile-decode true`` unless
``kvserve up`` was given ``--compile-decode``: one user's decode steps run compiled (``engine.models.compiled_decode``).
What the options of ``UpSettings`` become for each child is
``kvserve.settings``'s docstring.

With ``--config FILE`` every child gets the file too (``engine.config_file``), and the plan reads each child's
command line as that child will, file included: a key of any section its process does not know, or a value
it refuses, ends ``kvserve up`` before anything starts. So does a key that sets what the launcher sets on a
child's command line itself (``planned``: its host, ports, worker id, threads, drain timeout, GPU share,
tensor-parallel size and, where set, compiled decode), which the flag would silently override.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pydantic_settings import BaseSettings

from decode_service.settings import DecodeSettings
from engine.config import ModelSettings
from engine.config_file import ConfigFile
from kvserve.settings import UpSettings
from prefill_service.settings import PrefillSettings
from router.settings import RouterSettings
from rpc.settings import argv_of, config_argv, fields_of, settings_argv, settings_from_argv
from rpc.threads import host_cores
from rpc.worker_options import WORKER_SET_FIELDS
from security.cluster_tls import split_public_tls

DECODE_PORTS, PREFILL_PORTS, ROUTER_PORTS, METRICS_PORTS = 10, 30, 50, 1000  # offsets from the router's port, and
# a worker's
# Each child's settings model and the fields it sets itself, by its role: its section of a --config file.
CHILD_SETTINGS: dict[str, tuple[type[BaseSettings], tuple[str, ...]]] = {
    "decode": (DecodeSettings, WORKER_SET_FIELDS), "prefill": (PrefillSettings, WORKER_SET_FIELDS),
    "router": (RouterSettings, ())}  # fmt: skip


@dataclass(frozen=True)
class ExtraArgv:
    """Flags for one role's processes beyond what ``UpSettings`` says (tests and benchmarks: a decode worker's
    ``--prefill-timeout-s``, a prefill worker's ``--max-wait-ms``); they come last, so they win."""

    decode: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()
    router: tuple[str, ...] = ()


@dataclass(frozen=True)
class ChildPlan:
    name: str  # "decode-0", "prefill-0", "router" (then "router-1", ... with --routers N)
    role: str  # "decode", "prefill" or "router"
    port: int
    argv: tuple[str, ...]  # its command line, less the credential flags ``launch`` adds
    metrics_port: int  # a worker's /metrics; a router serves its own on its HTTP port (0: none)
    planned: tuple[str, ...]  # the options the launcher sets on ``argv`` itself, not passed on from its own


@dataclass(frozen=True)
class ClusterPlan:
    up: UpSettings
    host: str
    children: tuple[ChildPlan, ...]  # in start order: the decode workers, the prefill workers, the routers
    public_argv: tuple[str, ...]  # the router's --tls-* flags, which serve its public port only

    @property
    def ports(self) -> list[int]:
        """Every port the children will listen on: checked free before anything starts."""
        workers = [c for c in self.children if c.role != "router"]
        routers = [c for c in self.children if c.role == "router"]
        return [*(c.port for c in routers), *(c.metrics_port for c in routers if c.metrics_port),
                *(c.port for c in workers), *(c.metrics_port for c in workers)]  # fmt: skip

    @property
    def worker_ids(self) -> set[str]:
        return {c.name for c in self.children if c.role != "router"}

    @property
    def http_endpoint(self) -> str | None:
        """The (first) router's OpenAI-compatible API, ``http(s)://HOST:PORT``; None without one."""
        return self.http_endpoint_of(self.up.http_port)

    def http_endpoint_of(self, http_port: int) -> str | None:
        scheme = "https" if self.public_argv else "http"
        return f"{scheme}://{self.host}:{http_port}" if http_port else None


def plan_cluster(up: UpSettings, extra: ExtraArgv | None = None, host: str = "127.0.0.1") -> ClusterPlan:
    """The plan of ``up``'s cluster on ``host``; ``ValueError`` for options that cannot work together."""
    extra = extra or ExtraArgv()
    if up.redis_tcp and up.redis_url:
        raise ValueError("--redis-tcp is for the embedded Redis, and --redis-url (or $KVSERVE_REDIS_URL) names another")
    shares = gpu_memory_shares(up.prefill_gpu_memory_utilization, up.decode_gpu_memory_utilization, up.prefill,
                               up.decode)  # fmt: skip
    shared_argv, public_argv = split_public_tls(up.security_argv())
    threads, compute_lease = compute_shares(up)
    worker_argv = [*shared_argv, *up.tracing_argv(), *up.engine_argv(), *config_argv(up)]
    children = []
    for role, count, offset, role_argv in (("decode", up.decode, DECODE_PORTS, [*up.decode_argv(), *extra.decode]),
                                           ("prefill", up.prefill, PREFILL_PORTS, extra.prefill)):  # fmt: skip
        for i in range(count):
            port, name = up.port + offset + i, f"{role}-{i}"
            planned = {"host": host, "port": port, "worker_id": name, "metrics_port": port + METRICS_PORTS,
                       "threads": threads, "compute_lease": compute_lease, "drain_timeout": up.drain_timeout,
                       "gpu_memory_utilization": shares[role], "tensor_parallel_size": up.role_tp(role)}  # fmt: skip
            if role == "decode" and up.compile_decode is None and on_cpu_host(up):
                planned["compile_decode"] = True  # one user's decode steps compiled (engine.models.compiled_decode)
            argv = (sys.executable, "-m", f"{role}_service", *argv_of(planned), *worker_argv, *role_argv)
            children.append(ChildPlan(name, role, port, argv, port + METRICS_PORTS, tuple(planned)))
    for i in range(up.routers):  # replicas: each reads the same registry and calls the same workers
        port = up.port if i == 0 else up.port + ROUTER_PORTS + i
        http_port = up.http_port + i if up.http_port else 0
        planned = {"host": host, "port": port, "http_port": http_port, "drain_timeout": up.drain_timeout}
        router = (sys.executable, "-m", "router", *argv_of(planned), *settings_argv(up, fields_of(ModelSettings)),
                  *shared_argv, *public_argv, *up.tracing_argv(), *up.router_argv(), *config_argv(up),
                  *extra.router)  # fmt: skip
        children.append(ChildPlan("router" if i == 0 else f"router-{i}", "router", port, router, http_port,
                                  tuple(planned)))  # fmt: skip
    if up.config_file is not None:
        check_config_file(up.config_file, children)
    return ClusterPlan(up, host, tuple(children), tuple(public_argv))


def check_config_file(config: ConfigFile, children: list[ChildPlan]) -> None:
    """``ValueError`` naming the file and the key for a section's key its process does not know (whether or
    not the cluster starts one), a value a child would refuse, or a key that sets what a child's command line
    sets already (``ChildPlan.planned``), read as each child will read it."""
    for role, (model_cls, exclude) in CHILD_SETTINGS.items():
        config.options(role, fields_of(model_cls, exclude))
    for child in children:
        model_cls, exclude = CHILD_SETTINGS[child.role]
        for name in child.planned:
            if name in config.top_level or name in config.sections.get(child.role, {}):
                raise ValueError(f"{config.path}: {config.key(child.role, name)}: kvserve up sets each process's "
                                 f"{name} itself (see kvserve up --help)")  # fmt: skip
        try:
            settings_from_argv(model_cls, child.argv[3:], child.role, exclude)
        except ValueError as err:
            raise ValueError(f"{child.name}: {err}") from None


def compute_shares(up: UpSettings) -> tuple[int, str | None]:
    """(``--threads``, ``--compute-lease``) of each compute worker: on a CPU host with two or more workers and no
    ``--threads``, all the cores and a lease file of this cluster's (its router port names it); else
    ``threads_per_worker`` and no lease."""
    if up.threads is None and on_cpu_host(up) and up.prefill + up.decode >= 2:
        runtime = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        return host_cores(), str(runtime / f"kvserve-{os.getuid()}-{up.port}-compute")
    return threads_per_worker(up.prefill + up.decode, up.threads), None


def on_cpu_host(up: UpSettings) -> bool:
    """Whether the workers compute on the CPU: ``--device cpu``, or ``auto`` on a host without CUDA."""
    import torch

    return up.device == "cpu" or (up.device == "auto" and not torch.cuda.is_available())


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
