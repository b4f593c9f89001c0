"""The cluster's child processes as the supervisor sees them (``kvserve.launcher.supervisor.Supervised``): a gRPC
worker or the router (``Child``) and the embedded Redis (``RedisChild``)."""

from __future__ import annotations

import logging
import secrets
import subprocess
from pathlib import Path

from kvserve.launcher.child_process import describe_exit, die_with_parent, listens
from kvserve.launcher.redis_server import EmbeddedRedis
from kvstore.shared_pool import SHM_DIR_ENV, pool_file_name
from rpc.server import INSTANCE_ENV, wait_healthy
from security.auth import Security
from security.identity import Identity

HEALTH_PROBE_S = 0.1
_STDERR_FD = 2  # the launcher's own stderr, even where ``sys.stderr`` is replaced (pytest)

log = logging.getLogger(__name__)


class Child:
    """One gRPC process of the cluster, a worker or the router. ``start`` runs it again with the same command
    line (and so the same port and worker id); ``proc`` is always the latest process started.

    Every start gets a new secret instance id in its environment (``INSTANCE_ENV``), and ``answers`` accepts
    only a health answer that proves it (``rpc.server``): another process on the child's port is never
    taken for the child. With cluster certificates (``security.identity``) the check's TLS also accepts only
    a server whose certificate names this child."""

    def __init__(self, name: str, role: str, address: str, argv: list[str], env: dict[str, str],
                 security: Security, log_path: Path | None, metrics_url: str = "-") -> None:  # fmt: skip
        self.name, self.role, self.address, self.metrics_url = name, role, address, metrics_url
        self._argv, self._env, self._security, self._log_path = argv, env, security, log_path
        self.proc: subprocess.Popen | None = None
        self._instance_id: str | None = None
        self._peer = Identity(role, name) if security.identity is not None else None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        """Start the process; its output goes to its log file, else to the launcher's stderr."""
        out = open(self._log_path, "a") if self._log_path else _STDERR_FD
        self._instance_id = secrets.token_hex(16)
        try:
            env = {**self._env, INSTANCE_ENV: self._instance_id}
            self.proc = subprocess.Popen(self._argv, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
                                         process_group=0)  # fmt: skip
        finally:
            if self._log_path:
                out.close()

    def exit_status(self) -> str | None:
        code = self.proc.poll() if self.proc is not None else None
        return None if code is None else describe_exit(code)

    def answers(self, timeout_s: float = HEALTH_PROBE_S) -> bool:
        return self._instance_id is not None and wait_healthy(self.address, timeout_s, self._security,
                                                              self._instance_id, self._peer)  # fmt: skip

    def port_taken(self) -> bool:
        host, port = self.address.rsplit(":", 1)
        return listens(host, int(port))

    def remove_leftovers(self) -> None:
        """Remove what the dead process left behind: a decode worker's shared-memory KV pool file (and its
        tensor-parallel ranks' part files), in the directory its environment gave it (``SHM_DIR_ENV``), so no
        prefill worker maps a dead pool."""
        shm_dir = self._env.get(SHM_DIR_ENV)
        if self.role == "decode" and shm_dir and self.proc is not None:
            (Path(shm_dir) / pool_file_name(self.name, self.proc.pid)).unlink(missing_ok=True)
            for part in Path(shm_dir).glob(pool_file_name(f"{self.name}-r*", self.proc.pid)):
                part.unlink(missing_ok=True)

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()

    def line(self) -> str:
        """``<name> <role> grpc=HOST:PORT metrics=URL`` (``-``: none)."""
        return f"{self.name} {self.role} grpc={self.address} metrics={self.metrics_url}"


class RedisChild:
    """The embedded Redis as a supervised process: restarted on the same port, so clients reconnect."""

    name = role = "redis"

    def __init__(self, redis: EmbeddedRedis) -> None:
        self.redis = redis

    @property
    def pid(self) -> int | None:
        return self.redis.pid

    def start(self) -> None:
        try:
            self.redis.restart()
        except RuntimeError as err:  # seen as a death on the next check, so it counts as a failed start
            log.warning("redis-server did not restart: %s", err)

    def exit_status(self) -> str | None:
        return None if self.redis.alive else "died"

    def answers(self) -> bool:
        return self.redis.alive

    def port_taken(self) -> bool:  # its unix socket lies in a private directory: only its TCP port can be taken
        return self.redis.port != 0 and listens("127.0.0.1", self.redis.port)

    def remove_leftovers(self) -> None:
        """Nothing to remove: ``restart`` reuses the same scratch directory and socket path."""

    def kill(self) -> None:
        self.redis.stop()
