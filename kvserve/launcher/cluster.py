"""``kvserve up``: a whole local cluster (embedded Redis, prefill and decode workers, router) as processes:
``launch`` runs what ``kvserve.launcher.plan.plan_cluster`` planned (ports, command lines, start order), and
``start_cluster`` does both. Every child gets, through its environment (never its command line, which ``ps``
shows):

* ``KVSERVE_CLUSTER_TOKEN``: the child's credential, the keys of its role only (``security.keys``), derived from
  the cluster token (one is generated when none is given), unless the cluster runs with
  ``--insecure-internal``;
* ``KVSERVE_SHM_DIR``: the cluster's own directory of shared-memory KV pools (``kvserve-<uid>-cluster-<port>``
  under /dev/shm, mode 0700), cleared of dead processes' pools at start and removed on a clean stop;
* ``KVSERVE_INSTANCE_ID``: a secret of this start of this child, new at every restart, which its health
  answers prove (``rpc.server``): the launcher counts a child as serving only when that child answers;
* ``KVSERVE_API_KEY`` (the router's): the API key clients must send (``kvserve up --api-key``;
  otherwise the launcher's own ``$KVSERVE_API_KEY``, inherited like the rest of its environment);
* ``KVSERVE_REDIS_URL``: the registry, password included (a ``--redis-url`` given to ``kvserve up`` goes
  the same way). Without one, the launcher starts an embedded Redis that only the cluster can use: a unix
  socket in the pool directory (mode 0700), no TCP port unless ``--redis-tcp``, and a generated password.

Internal gRPC runs over mutual TLS (unless ``--internal-tls false`` or the cluster is insecure): each start
makes a cluster CA, whose key stays in the launcher's memory, and a certificate per child naming its role
and name (``security.certs``), in ``tls-<launcher pid>/<child>/`` of the pool directory (mode 0700, removed on
a clean stop), passed with ``--cluster-certs``. The launcher checks its children's health with a certificate
of its own (role ``launcher``, which may call no internal service). The router's public port stays as the
user asked: plain, or ``--tls-*`` (which only the router gets).

The launcher holds its pool directory and its Redis's scratch directory while it lives (``kvserve.launcher.scratch``),
and every start removes the ones of this user's clusters whose launcher died (SIGKILL skips the clean stop).

Every child is started with ``die_with_parent`` and in its own process group: a SIGKILLed launcher takes
its children along, and a terminal's Ctrl-C reaches the launcher only, which then stops them all (each drains).
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from cluster_state.registry import Registry
from engine.bundled import resolve_model
from kvserve.launcher.plan import ClusterPlan, ExtraArgv, plan_cluster
from kvserve.launcher.processes import Child, RedisChild
from kvserve.launcher.redis_server import EmbeddedRedis
from kvserve.launcher.scratch import HeldDir, cluster_shm_dir, hold_dir, remove_dead_clusters, remove_if_abandoned
from kvserve.settings import UpSettings
from kvstore.shared_pool import SHM_DIR_ENV, remove_stale_pools
from rpc import tracing
from rpc.options import REDIS_URL_ENV, SecuritySettings
from rpc.requests import API_KEY_ENV
from rpc.settings import env_name
from security.auth import TOKEN_ENV, Security
from security.cluster_tls import ClusterCredentials, public_security

log = logging.getLogger(__name__)
# A decode worker re-reads the registry's prefill workers every ``decode_service.prefill_client.REFRESH_S`` (1 s;
# importing it here would load the engine): once every worker is registered, one period more and each decode
# worker's view holds them all, so the first requests spread over every prefill worker. tests/unit/test_cluster_plan.py
# pins the two together.
WORKER_VIEWS_SETTLE_S = 1.2


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
    credentials: ClusterCredentials | None = field(default=None, repr=False)  # what each child is started with

    @property
    def endpoints(self) -> list[str]:
        """Every router's gRPC address (``endpoint`` is the first's): what a failover client is given."""
        return [child.address for child in self.children if child.role == "router"]

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


def _child_env(shm_dir: Path, redis_url: str) -> dict[str, str]:
    """Ours, less the token and security settings: children get their own (credential, ``security_argv``)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", SHM_DIR_ENV: str(shm_dir), REDIS_URL_ENV: redis_url}
    for name in (TOKEN_ENV, *(env_name(SecuritySettings, option) for option in SecuritySettings.model_fields)):
        env.pop(name, None)
    return env


def start_cluster(up: UpSettings, extra: ExtraArgv | None = None, security: Security | None = None,
                  startup_timeout_s: float = 180.0) -> Cluster:  # fmt: skip
    """``launch(plan_cluster(up, extra), ...)``: start ``up``'s cluster on this host."""
    return launch(plan_cluster(up, extra), security, startup_timeout_s)


def launch(plan: ClusterPlan, security: Security | None = None, startup_timeout_s: float = 180.0) -> Cluster:
    """Start the planned cluster and wait until every process answers its health check and every worker is
    in the registry.

    ``security`` is the launcher's own (a fresh random token when ``None``); each child gets a credential of
    its role derived from its token, through its environment. Raises ``RuntimeError`` for a port in use before
    starting anything, and (after stopping what started) when a process exits or does not answer within
    ``startup_timeout_s``.
    """
    up = plan.up
    resolve_model(up.model)  # convert the bundled model once, before the workers race for it
    security = security or Security(token=secrets.token_urlsafe(32))
    check_ports_free(plan.host, plan.ports)
    if up.log_dir:
        Path(up.log_dir).mkdir(parents=True, exist_ok=True)
    cluster = _prepare(plan, security)
    span = tracing.start("launcher.start", decode_workers=up.decode, prefill_workers=up.prefill)
    try:
        env = _child_env(cluster.shm_dir, cluster.redis_url)
        for child in plan.children:
            router = child.role == "router"
            child_env = {**env, API_KEY_ENV: up.api_key} if router and up.api_key else env
            http = plan.http_endpoint_of(child.metrics_port) if router else None
            metrics = f"{http}/metrics" if http else "-"
            if not router:
                metrics = f"http://{plan.host}:{child.metrics_port}/metrics"
            cluster.children.append(_child(child.name, child.role, f"{plan.host}:{child.port}",
                                           [*child.argv, *cluster.credentials.argv(child.role, child.name)],
                                           cluster.credentials.env(child.role, child_env),
                                           public_security(list(plan.public_argv)) if router else cluster.security,
                                           up.log_dir, metrics))  # fmt: skip
            span.event("started", role=child.role, name=child.name, pid=cluster.children[-1].pid)
        deadline = time.monotonic() + startup_timeout_s
        for child in cluster.children:
            while not child.answers(timeout_s=1.0):
                if (status := child.exit_status()) is not None:
                    raise RuntimeError(f"{child.role} {child.name} {status} during start-up")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{child.name} did not become healthy within {startup_timeout_s:.0f} s")
            span.event("serving", role=child.role, name=child.name)
        _wait_registered(cluster.redis_url, cluster.security, plan.worker_ids, deadline)
        span.end()
        return cluster
    except BaseException as err:
        span.end(type(err).__name__)
        cluster.stop()
        raise


def _prepare(plan: ClusterPlan, security: Security) -> Cluster:
    """The cluster before its children: its pool directory held (dead clusters' removed first), the children's
    credentials made, the embedded Redis started (unless ``--redis-url`` names one)."""
    up = plan.up
    for path in remove_dead_clusters():
        log.info("removed %s, left behind by a cluster whose launcher died", path)
    shm_hold = hold_dir(cluster_shm_dir(up.port))
    shm_dir = shm_hold.path
    remove_stale_pools(shm_dir)
    try:
        creds = ClusterCredentials(security, shm_dir / f"tls-{os.getpid()}", plan.host, up.internal_tls)
        embedded = None if up.redis_url is not None else EmbeddedRedis(
            port=None if up.redis_tcp else 0, password=secrets.token_urlsafe(32),
            unix_socket=shm_dir / f"redis-{os.getpid()}.sock",  # our launcher's: another cluster may share shm_dir
        )  # fmt: skip
    except BaseException:
        shm_hold.release()
        remove_if_abandoned(shm_dir)
        raise
    return Cluster(endpoint=f"{plan.host}:{up.port}", redis_url=embedded.url if embedded is not None else up.redis_url,
                   shm_dir=shm_dir, security=creds.launcher, stop_timeout_s=up.drain_timeout + 5.0, redis=embedded,
                   http_endpoint=plan.http_endpoint, shm_hold=shm_hold, tls_dir=creds.tls_dir,
                   credentials=creds)  # fmt: skip


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
    time.sleep(WORKER_VIEWS_SETTLE_S)  # their views cannot be read from here: wait out one refresh period


def _child(name: str, role: str, address: str, argv: list[str], env: dict[str, str], security: Security,
           log_dir: str | Path | None, metrics_url: str = "-") -> Child:  # fmt: skip
    log_path = Path(log_dir) / f"{name}.log" if log_dir else None
    child = Child(name, role, address, argv, env, security, log_path, metrics_url)
    child.start()
    return child
