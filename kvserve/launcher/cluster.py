"""``kvserve up``: a whole local cluster (embedded Redis, prefill and decode workers, router) as processes.

Ports: the router listens on ``port`` (gRPC) and ``http_port`` (the OpenAI-compatible API; 0: none), decode
worker *i* on ``port + 10 + i``, prefill worker *i* on ``port + 30 + i``. Every child gets, through its
environment (never its command line, which ``ps`` shows):

* ``KVSERVE_CLUSTER_TOKEN``: the child's credential, the keys of its role only (``security.keys``), derived from
  the cluster token (one is generated when none is given), unless the cluster runs with
  ``--insecure-internal``;
* ``KVSERVE_SHM_DIR``: the cluster's own directory of shared-memory KV pools (``kvserve-<uid>-cluster-<port>``
  under /dev/shm, mode 0700), cleared of dead processes' pools at start and removed on a clean stop;
* ``KVSERVE_INSTANCE_ID``: a secret of this start of this child, new at every restart, which its health
  answers prove (``rpc.server``): the launcher counts a child as serving only when that child answers;
* ``KVSERVE_API_KEY`` (the router's): the API key clients must send (``api_key``, ``kvserve up --api-key``;
  otherwise the launcher's own ``$KVSERVE_API_KEY``, inherited like the rest of its environment);
* ``KVSERVE_REDIS_URL``: the registry, password included (a ``--redis-url`` given to ``kvserve up`` goes
  the same way). Without one, the launcher starts an embedded Redis that only the cluster can use: a unix
  socket in the pool directory (mode 0700), no TCP port unless ``redis_tcp``, and a generated password.

Internal gRPC runs over mutual TLS (unless ``internal_tls`` is false or the cluster is insecure): each start
makes a cluster CA, whose key stays in the launcher's memory, and a certificate per child naming its role
and name (``security.certs``), in ``tls-<launcher pid>/<child>/`` of the pool directory (mode 0700, removed on
a clean stop), passed with ``--cluster-certs``. The launcher checks its children's health with a certificate
of its own (role ``launcher``, which may call no internal service). The router's public port stays as the
user asked: plain, or ``--tls-*`` (which only the router gets).

The launcher holds its pool directory and its Redis's scratch directory while it lives (``kvserve.launcher.scratch``),
and every start removes the ones of this user's clusters whose launcher died (SIGKILL skips the clean stop).

Every child is started with ``die_with_parent`` and in its own process group: a SIGKILLed launcher takes
its children along, and a terminal's Ctrl-C reaches the launcher only, which then stops them all (each drains).
Compute workers get ``--threads``: their share of the host's cores, so they do not preempt each other, and
``--gpu-memory-utilization``: their share of the GPU's total memory, since every worker runs on the same GPU
(``gpu_memory_shares``; ignored on the CPU).
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from cluster_state.registry import Registry
from engine.bundled import resolve_model
from engine.config import ModelSettings
from kvserve.launcher.processes import Child, RedisChild
from kvserve.launcher.redis_server import EmbeddedRedis
from kvserve.launcher.scratch import HeldDir, cluster_shm_dir, hold_dir, remove_dead_clusters, remove_if_abandoned
from kvstore.shared_pool import SHM_DIR_ENV, remove_stale_pools
from rpc.options import REDIS_URL_ENV, SecuritySettings
from rpc.requests import API_KEY_ENV
from rpc.settings import env_name, fields_of, settings_argv, settings_from_argv
from rpc.threads import host_cores
from security.auth import TOKEN_ENV, Security
from security.cluster_tls import ClusterCredentials, public_security, split_public_tls

log = logging.getLogger(__name__)
_WORKER_VIEWS_SETTLE_S = 1.2  # decode workers re-read the registry's prefill workers about once a second


@dataclass
class Cluster:
    """The started cluster. ``stop`` sends every child SIGTERM at once (each drains), SIGKILLs what is left
    after ``stop_timeout_s``, stops an embedded Redis and removes the pool directory (unless another cluster
    on the same port holds it too, or a process of one still has a pool there)."""

    endpoint: str
    redis_url: str = field(repr=False)  # it may hold the password
    shm_dir: Path
    security: Security
    stop_timeout_s: float
    children: list[Child] = field(default_factory=list)
    redis: EmbeddedRedis | None = None
    http_endpoint: str | None = None  # the router's OpenAI-compatible API, "http(s)://HOST:PORT"
    shm_hold: HeldDir | None = None  # our hold on ``shm_dir`` (see kvserve.launcher.scratch)
    tls_dir: Path | None = None  # the children's cluster certificates (in ``shm_dir``)

    def child(self, name: str) -> Child:
        [found] = [c for c in self.children if c.name == name]
        return found

    def units(self) -> list[Child | RedisChild]:
        """What ``kvserve.launcher.supervisor.Supervisor`` watches: every child, and the embedded Redis if any."""
        return [*self.children, *([RedisChild(self.redis)] if self.redis is not None else [])]

    def lines(self) -> list[str]:
        return [child.line() for child in self.children]

    def stop(self) -> None:
        for child in reversed(self.children):
            child.terminate()
        deadline = time.monotonic() + self.stop_timeout_s
        for child in self.children:
            if child.proc is None:
                continue
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.proc.wait()
        self.children.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        remove_stale_pools(self.shm_dir)  # ours are dead now
        if self.tls_dir is not None:
            shutil.rmtree(self.tls_dir, ignore_errors=True)
        if self.shm_hold is not None:
            self.shm_hold.release()
        remove_if_abandoned(self.shm_dir)


def free_base_port(num_workers: int = 4, host: str = "127.0.0.1") -> int:
    """A router port whose layout under ``start_cluster`` is free: it, the HTTP port after it (+1), the decode
    (+10..) and prefill (+30..) workers' ports and their metrics ports (+1000). For tests and scripts."""
    for _ in range(100):
        base = random.randrange(20000, 59000, 100)
        workers = [*range(base + 10, base + 10 + num_workers), *range(base + 30, base + 30 + num_workers)]
        try:
            check_ports_free(host, [base, base + 1, *workers, *(p + 1000 for p in workers)])
            return base
        except RuntimeError:
            continue
    raise RuntimeError("no free port range found")


def check_ports_free(host: str, ports: list[int]) -> None:
    """Refuse ports something listens on already: gRPC servers share a port by default (SO_REUSEPORT), so a
    second cluster on the same ports would otherwise start and split the traffic with the first."""
    for port in ports:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT left by a past run is fine
            try:
                probe.bind((host, port))
            except OSError as err:
                raise RuntimeError(f"port {port} on {host} is in use ({err.strerror}); choose another --port") from None


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


def _child_env(shm_dir: Path, redis_url: str) -> dict[str, str]:
    """Ours, less the token and security settings: children get their own (credential, ``security_argv``)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", SHM_DIR_ENV: str(shm_dir), REDIS_URL_ENV: redis_url}
    for name in (TOKEN_ENV, *(env_name(SecuritySettings, option) for option in SecuritySettings.model_fields)):
        env.pop(name, None)
    return env


def start_cluster(
    *,
    num_prefill: int = 1,
    num_decode: int = 1,
    port: int = 50051,
    http_port: int = 0,
    host: str = "127.0.0.1",
    redis_url: str | None = None,
    engine_argv: list[str] | None = None,
    decode_argv: list[str] | None = None,
    prefill_argv: list[str] | None = None,
    router_argv: list[str] | None = None,
    redis_tcp: bool = False,
    internal_tls: bool = True,
    prefill_gpu_memory_utilization: float = 0.35,
    decode_gpu_memory_utilization: float = 0.5,
    security: Security | None = None,
    security_argv: list[str] | None = None,
    threads: int | None = None,
    drain_timeout_s: float = 30.0,
    startup_timeout_s: float = 180.0,
    log_dir: str | Path | None = None,
    api_key: str | None = None,
) -> Cluster:
    """Start the cluster and wait until every process answers its health check.

    ``security`` is the launcher's own (a fresh random token when ``None``); each child gets a credential of
    its role derived from its token, through its environment. ``security_argv`` is passed to every child as
    it is (``--insecure-internal``), but ``--tls-*``, which serve the router's public port, to the router
    only. ``internal_tls``: internal gRPC over mutual TLS with certificates of a new cluster CA (see the
    module docstring); false: the token-only mode. ``*_gpu_memory_utilization``: see ``gpu_memory_shares``
    (the defaults leave 15% of the GPU to other processes). ``redis_tcp``: the embedded Redis also listens on
    a free TCP port of 127.0.0.1 (``Cluster.redis.port``), with the same password. ``api_key``: the key the
    router's clients must send, handed to the router in its environment. Raises ``ValueError`` for shares that do not
    fit, before starting anything, and ``RuntimeError`` (after stopping what started) when a process exits
    or does not answer within ``startup_timeout_s``.
    """
    shares = gpu_memory_shares(prefill_gpu_memory_utilization, decode_gpu_memory_utilization, num_prefill,
                               num_decode)  # fmt: skip
    engine_argv = engine_argv or []
    model = settings_from_argv(ModelSettings, engine_argv)  # the router's part of the workers' options
    resolve_model(model.model)  # convert the bundled model once, before the workers race for it
    security = security or Security(token=secrets.token_urlsafe(32))
    shared_argv, public_argv = split_public_tls(security_argv or [])
    decode_ports = [port + 10 + i for i in range(num_decode)]
    prefill_ports = [port + 30 + i for i in range(num_prefill)]
    metrics_offset = 1000  # a worker's /metrics port: its gRPC port + 1000
    check_ports_free(host, [port, *([http_port] if http_port else []), *decode_ports, *prefill_ports,
                            *(p + metrics_offset for p in decode_ports + prefill_ports)])  # fmt: skip
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
    for path in remove_dead_clusters():
        log.info("removed %s, left behind by a cluster whose launcher died", path)
    shm_hold = hold_dir(cluster_shm_dir(port))
    shm_dir = shm_hold.path
    remove_stale_pools(shm_dir)
    try:
        creds = ClusterCredentials(security, shm_dir / f"tls-{os.getpid()}", host, internal_tls)
        embedded = None if redis_url is not None else EmbeddedRedis(
            port=None if redis_tcp else 0, password=secrets.token_urlsafe(32),
            unix_socket=shm_dir / f"redis-{os.getpid()}.sock",  # our launcher's: another cluster may share shm_dir
        )  # fmt: skip
    except BaseException:
        shm_hold.release()
        remove_if_abandoned(shm_dir)
        raise
    url = embedded.url if embedded is not None else redis_url
    cluster = Cluster(endpoint=f"{host}:{port}", redis_url=url, shm_dir=shm_dir, security=creds.launcher,
                      stop_timeout_s=drain_timeout_s + 5.0, redis=embedded,
                      http_endpoint=f"{'https' if public_argv else 'http'}://{host}:{http_port}"
                      if http_port else None, shm_hold=shm_hold, tls_dir=creds.tls_dir)  # fmt: skip
    env = _child_env(shm_dir, url)
    worker_argv = ["--threads", str(threads_per_worker(num_prefill + num_decode, threads)),
                   "--drain-timeout", str(drain_timeout_s), *shared_argv, *engine_argv]  # fmt: skip
    role_argv = {role: [*worker_argv, "--gpu-memory-utilization", str(shares[role]), *(extra or [])]
                 for role, extra in (("decode", decode_argv), ("prefill", prefill_argv))}  # fmt: skip
    specs = [(f"decode-{i}", "decode", p, role_argv["decode"]) for i, p in enumerate(decode_ports)]
    specs += [(f"prefill-{i}", "prefill", p, role_argv["prefill"]) for i, p in enumerate(prefill_ports)]
    try:
        for name, role, child_port, extra in specs:
            metrics_port = child_port + metrics_offset
            argv = [sys.executable, "-m", f"{role}_service", "--host", host, "--port", str(child_port),
                    "--worker-id", name, "--metrics-port", str(metrics_port), *creds.argv(role, name), *extra]
            cluster.children.append(_child(name, role, f"{host}:{child_port}", argv, creds.env(role, env),
                                           creds.launcher, log_dir, f"http://{host}:{metrics_port}/metrics"))
        router_cmd = [sys.executable, "-m", "router", "--host", host, "--port", str(port),
                      "--http-port", str(http_port), "--drain-timeout", str(drain_timeout_s),
                      *settings_argv(model, fields_of(ModelSettings)), *shared_argv, *public_argv,
                      *creds.argv("router", "router"), *(router_argv or [])]  # fmt: skip
        router_metrics = f"{cluster.http_endpoint}/metrics" if cluster.http_endpoint else "-"
        router_env = creds.env("router", {**env, API_KEY_ENV: api_key} if api_key else env)
        cluster.children.append(_child("router", "router", cluster.endpoint, router_cmd, router_env,
                                       public_security(public_argv), log_dir, router_metrics))  # fmt: skip
        deadline = time.monotonic() + startup_timeout_s
        for child in cluster.children:
            while not child.answers(timeout_s=1.0):
                if (status := child.exit_status()) is not None:
                    raise RuntimeError(f"{child.role} {child.name} {status} during start-up")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{child.name} did not become healthy within {startup_timeout_s:.0f} s")
        _wait_registered(url, creds.launcher, {name for name, *_ in specs}, deadline)
        return cluster
    except BaseException:
        cluster.stop()
        raise


def _wait_registered(url: str, security: Security, worker_ids: set[str], deadline: float) -> None:
    """Wait until the registry lists every worker, then for the decode workers' views of it to catch up, so the
    first requests already spread over every prefill worker."""
    registry = Registry(url, security=security)
    try:
        while not worker_ids <= {w.worker_id for w in registry.workers()}:
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers {sorted(worker_ids)} did not all register in Redis in time")
            time.sleep(0.05)
    finally:
        registry.stop()
    time.sleep(_WORKER_VIEWS_SETTLE_S)  # their views cannot be read from here: wait out one refresh period


def _child(name: str, role: str, address: str, argv: list[str], env: dict[str, str], security: Security,
           log_dir: str | Path | None, metrics_url: str = "-") -> Child:  # fmt: skip
    log_path = Path(log_dir) / f"{name}.log" if log_dir else None
    child = Child(name, role, address, argv, env, security, log_path, metrics_url)
    child.start()
    return child
