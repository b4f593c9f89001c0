"""``kvserve up``: a whole local cluster (embedded Redis, prefill and decode workers, router) as processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from engine.bundled import resolve_model
from kvserve.redis_server import EmbeddedRedis, ensure_redis
from rpc.server import wait_healthy


@dataclass
class Cluster:
    """Child processes in start order; ``stop`` ends them in reverse and stops an embedded Redis."""

    endpoint: str
    redis_url: str
    processes: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    redis: EmbeddedRedis | None = None

    def stop(self, timeout_s: float = 10.0) -> None:
        for _, proc in reversed(self.processes):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for _, proc in self.processes:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.processes.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None


def start_cluster(
    *,
    num_prefill: int = 1,
    num_decode: int = 1,
    port: int = 50051,
    host: str = "127.0.0.1",
    redis_url: str | None = None,
    engine_argv: list[str] | None = None,
    decode_argv: list[str] | None = None,
    prefill_argv: list[str] | None = None,
    startup_timeout_s: float = 180.0,
    log_dir: str | None = None,
) -> Cluster:
    engine_argv = engine_argv or ["--model", "default"]
    model = engine_argv[engine_argv.index("--model") + 1] if "--model" in engine_argv else "default"
    resolve_model(model)  # convert the bundled model once, before the workers race for it
    url, embedded = ensure_redis(redis_url)
    cluster = Cluster(endpoint=f"{host}:{port}", redis_url=url, redis=embedded)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        specs = []
        for i in range(num_decode):
            specs.append((f"decode-{i}", "decode_service", port + 10 + i, engine_argv + (decode_argv or [])))
        for i in range(num_prefill):
            specs.append((f"prefill-{i}", "prefill_service", port + 30 + i, engine_argv + (prefill_argv or [])))
        specs.append(("router", "router", port, ["--model", model]))
        for name, module, worker_port, extra in specs:
            cmd = [sys.executable, "-m", module, "--host", host, "--port", str(worker_port), "--redis-url", url]
            if module != "router":
                cmd += ["--worker-id", name]
            out = open(os.path.join(log_dir, f"{name}.log"), "w") if log_dir else subprocess.DEVNULL
            proc = subprocess.Popen(cmd + extra, env=env, stdout=out, stderr=subprocess.STDOUT)
            cluster.processes.append((f"{name}@{host}:{worker_port}", proc))
        deadline = time.monotonic() + startup_timeout_s
        for name, proc in cluster.processes:
            address = name.split("@", 1)[1]
            while not wait_healthy(address, timeout_s=1.0):
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with code {proc.returncode} during start-up")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not become healthy within {startup_timeout_s:.0f} s")
        return cluster
    except BaseException:
        cluster.stop()
        raise


def run_until_signal(cluster: Cluster) -> None:
    """Block until Ctrl-C or SIGTERM (or a child dies), then stop everything."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            dead = [name for name, proc in cluster.processes if proc.poll() is not None]
            if dead:
                print(f"kvserve: {', '.join(dead)} exited; stopping the cluster", file=sys.stderr)
                break
    finally:
        cluster.stop()
