"""A 1P+1D cluster over three test hosts on one machine (``kvserve.testing.netns``): Redis and the router on one, a
prefill worker on another, a decode worker on a third. Shared memory between the workers is impossible, as
between machines, so KV crosses a real network link (veth pairs and a bridge) through ``grpc`` or ``nixl``.

Every process is the real entry point (``python -m router``, ``prefill_service``, ``decode_service``, the
embedded Redis's server binary), with a credential of its role from one cluster token, as ``kvserve up``
runs them; each worker registers the address it can be reached at (``--advertise``). The caller reaches the
router at ``MultiHost.endpoint`` through the root namespace's link. Used by ``tests/cluster/test_multihost.py`` and by
``kvserve bench serve --netns``. Leaving ``multihost_cluster`` kills every process with its host and deletes
every namespace and link.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cluster_state.registry import Registry
from engine.bundled import resolve_model
from engine.config import ModelSettings
from kvserve.launcher.processes import Child
from kvserve.launcher.redis_binary import find_server, lockdown_config
from kvserve.testing import netns
from rpc.options import REDIS_URL_ENV
from rpc.settings import fields_of, settings_argv, settings_from_argv
from security.auth import TOKEN_ENV, Security

ROUTER_PORT, DECODE_PORT, PREFILL_PORT, REDIS_PORT = 50051, 50061, 50071, 6379
START_TIMEOUT_S = 120.0


@dataclass
class MultiHost:
    """The running cluster: its hosts (front, prefill, decode), the router's address, Redis, the processes."""

    hosts: netns.Hosts
    endpoint: str
    redis_url: str
    registry: Registry
    children: dict[str, Child]


def _env(role: str, security: Security, redis_url: str, extra: dict[str, str]) -> dict[str, str]:
    """Ours without any KVSERVE_ setting (a pool directory, a token, an API key), plus the child's own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVE_")}
    return env | extra | {"PYTHONUNBUFFERED": "1", TOKEN_ENV: security.credential(role), REDIS_URL_ENV: redis_url}


def _redis(hosts: netns.Hosts, host: netns.Host, password: str, logs: Path) -> Child:
    server = find_server()
    config = logs / "redis.conf"
    config.touch(mode=0o600)
    lines = [("bind", host.address), ("port", str(REDIS_PORT)), ("save", ""), ("appendonly", "no"),
             ("dir", str(logs)), ("requirepass", password), *lockdown_config(server.version)]  # fmt: skip
    config.write_text("".join(" ".join(word or '""' for word in words) + "\n" for words in lines))
    return Child("redis", "redis", "-", hosts.command(host, [str(server.path), str(config)]), dict(os.environ),
                 Security.insecure(), logs / "redis.log")  # fmt: skip


@contextmanager
def multihost_cluster(engine_argv: list[str], logs: Path, decode_argv: list[str] = (), prefill_argv: list[str] = (),
                      worker_env: dict[str, str] | None = None, threads: int = 1) -> Iterator[MultiHost]:  # fmt: skip
    """Start the cluster (logs and Redis's files in ``logs``) and yield it once both workers are registered
    and the router answers. ``worker_env``: more environment for both workers; ``threads``: each worker's
    torch threads. The decode worker hands off every prompt (``--disagg-min-uncached-tokens 0``, no queue
    bound): moving KV between the hosts is what this cluster is for."""
    security, password = Security(token=secrets.token_urlsafe(32)), secrets.token_urlsafe(16)
    extra = dict(worker_env or {})
    model = settings_from_argv(ModelSettings, engine_argv)  # the router's part of the workers' options
    resolve_model(model.model)  # convert the bundled model once, before the workers race for it
    router_model_argv = settings_argv(model, fields_of(ModelSettings))
    with netns.Hosts(3) as hosts:
        front, prefill_host, decode_host = hosts.hosts
        url = f"redis://:{password}@{front.address}:{REDIS_PORT}/0"
        children = {"redis": _redis(hosts, front, password, logs)}
        children["redis"].start()
        handoff = ["--disagg-min-uncached-tokens", "0", "--disagg-max-prefill-queue", "0"]
        workers = (("decode-0", "decode", decode_host, DECODE_PORT, [*handoff, *decode_argv]),
                   ("prefill-0", "prefill", prefill_host, PREFILL_PORT, list(prefill_argv)))  # fmt: skip
        for name, role, host, port, more in workers:
            address = f"{host.address}:{port}"
            argv = [sys.executable, "-m", f"{role}_service", "--host", host.address, "--port", str(port),
                    "--advertise", address, "--worker-id", name, "--metrics-port", str(port + 1000),
                    "--threads", str(threads), "--drain-timeout", "2", *engine_argv, *more]  # fmt: skip
            children[name] = Child(name, role, address, hosts.command(host, argv), _env(role, security, url, extra),
                                   Security(security.token), logs / f"{name}.log")  # fmt: skip
        endpoint = f"{front.address}:{ROUTER_PORT}"
        router_argv = [sys.executable, "-m", "router", "--host", front.address, "--port", str(ROUTER_PORT),
                       "--http-port", "0", "--drain-timeout", "2", *router_model_argv]  # fmt: skip
        children["router"] = Child("router", "router", endpoint, hosts.command(front, router_argv),
                                   _env("router", security, url, {}), Security.insecure(), logs / "router.log")
        for name in ("decode-0", "prefill-0", "router"):
            children[name].start()
        registry = Registry(url, security=security)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            for name in ("decode-0", "prefill-0", "router"):
                while not children[name].answers(timeout_s=1.0):
                    if status := children[name].exit_status():
                        raise RuntimeError(f"{name} {status}: see {logs / (name + '.log')}")
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{name} did not answer within {START_TIMEOUT_S:.0f} s: see {logs}")
            deadline = time.monotonic() + 30
            while not {"decode-0", "prefill-0"} <= {w.worker_id for w in registry.workers()}:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the workers did not register within 30 s: see {logs}")
                time.sleep(0.1)
            time.sleep(1.2)  # the decode worker re-reads the registry's prefill workers about once a second
            yield MultiHost(hosts, endpoint, url, registry, children)
        finally:
            registry.stop()
            hosts.remove()
            for child in children.values():
                if child.proc is not None:
                    child.proc.wait(timeout=10)  # SIGKILLed with its host: reap it
