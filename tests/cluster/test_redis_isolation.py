"""Redis that only the cluster can use (issue 21's probe "Redis as another user"), against real clusters.

* Another local user can neither reach the embedded Redis (no TCP port; a unix socket in the cluster's 0700
  directory) nor, from the cluster's own uid without the password, run CONFIG SET + SAVE (a file written
  where it likes, as the cluster's user) or MODULE LOAD; with the password those commands do not exist.
* Load fields rewritten in Redis without the cluster token (``num_running`` of one worker's hash moved
  routing from 20/20 to 38/2; a non-integer on both decode workers made the router refuse every request)
  change neither where requests go nor whether they are served.
* The Redis password is on no process's command line (``/proc/PID/cmdline``, which every local user reads).
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

import pytest
import redis
from cluster_utils import discard, tiny_engine_argv
from redis_probe import NOBODY, listening, probe, probe_as

from kvserve.client import Client
from kvserve.launcher.cluster import Cluster, free_base_port, start_cluster
from kvserve.launcher.redis_server import EmbeddedRedis
from kvserve.settings import parse_up

pytestmark = pytest.mark.slow

NUM_REQUESTS = 40


@pytest.fixture(scope="module")
def two_decode(tmp_path_factory, tiny_model_dir) -> Iterator[Cluster]:
    """``kvserve up --prefill 0 --decode 2`` with its embedded Redis, on the tiny model (nothing here reads text)."""
    logs = str(tmp_path_factory.mktemp("logs"))
    c = start_cluster(parse_up(["--prefill", "0", "--decode", "2", "--port", str(free_base_port()), "--http-port", "0",
                                *tiny_engine_argv(tiny_model_dir), "--log-dir", logs]))  # fmt: skip
    yield c
    discard(c)


def test_another_local_user_cannot_use_the_clusters_redis(two_decode: Cluster, tmp_path: Path) -> None:
    target = tmp_path / "target"  # where the attacker wants a file of its choosing
    target.mkdir(mode=0o777)
    os.chmod(target, 0o777)
    tcp, unix = listening(two_decode.redis.pid)
    if os.geteuid() == 0:  # another uid, as the probe was
        as_nobody = probe_as(NOBODY, tcp, unix, str(target))
        assert list(target.iterdir()) == [], f"another user planted a file through Redis: {as_nobody}"
        assert all(len(replies) == 1 and "cannot connect" in replies[0] for replies in as_nobody.values()), as_nobody
    as_us = probe(tcp, unix, str(target))  # our own uid, without the password
    assert list(target.iterdir()) == [], f"a client without the password planted a file through Redis: {as_us}"
    assert all("NOAUTH" in reply for replies in as_us.values() for reply in replies), as_us
    assert tcp == [] and len(unix) == 1  # no TCP port to even connect to
    assert Path(unix[0]).parent == two_decode.shm_dir and (two_decode.shm_dir.stat().st_mode & 0o777) == 0o700

    with redis.Redis.from_url(two_decode.redis_url) as member:  # a cluster member, with the password
        for command in (("CONFIG", "SET", "dir", str(target)), ("MODULE", "LOAD", "/x.so"), ("DEBUG", "SLEEP", "0")):
            with pytest.raises(redis.ResponseError, match="unknown command"):
                member.execute_command(*command)


def _prompt(i: int) -> list[int]:
    return [1, 504, 345, 288, 234, 28, 195, 216 + i, 42]  # under one block: no prefix pulls it anywhere


def _send(c: Cluster, num_requests: int) -> tuple[Counter, list[str]]:
    """Eight clients share ``num_requests`` short greedy requests; (requests per decode worker, errors)."""

    def one(i: int) -> str:
        with Client(c.endpoint, timeout_s=120) as client:
            try:
                return client.generate(_prompt(i), max_tokens=4, temperature=0, ignore_eos=True).decode_worker
            except Exception as err:  # grpc.RpcError: counted, not raised, so the test reports them all
                return f"error: {err}"

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(num_requests)))
    return Counter(a for a in answers if not a.startswith("error")), [a for a in answers if a.startswith("error")]


@contextmanager
def _tampering(c: Cluster, fields: dict[str, str], worker_ids: list[str]) -> Iterator[None]:
    """Rewrite ``fields`` of the workers' hashes every 20 ms (a heartbeat every 1.7 s rewrites them back)."""
    stop = threading.Event()

    def tamper() -> None:
        with redis.Redis.from_url(c.redis_url) as raw:
            while not stop.wait(0.02):
                for worker_id in worker_ids:
                    raw.hset(f"kvserve:worker:{worker_id}", mapping=fields)

    thread = threading.Thread(target=tamper, name="tamper")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def test_tampered_load_fields_neither_steer_routing_nor_refuse_requests(two_decode: Cluster) -> None:
    with _tampering(two_decode, {"num_running": "1000"}, ["decode-0"]):
        served, errors = _send(two_decode, NUM_REQUESTS)
    assert errors == []
    assert min(served["decode-0"], served["decode-1"]) >= NUM_REQUESTS // 4, served  # untampered: about 20/20

    with _tampering(two_decode, {"num_running": "many", "free_blocks": "-1"}, ["decode-0", "decode-1"]):
        served, errors = _send(two_decode, 16)
    assert errors == [] and sum(served.values()) == 16, (served, errors[:3])


def _cmdlines() -> dict[int, str]:
    lines = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                lines[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue  # it exited meanwhile
    return lines


def _assert_nowhere_on_a_command_line(c: Cluster, password: str) -> None:
    pids = [child.pid for child in c.children] + ([c.redis.pid] if c.redis is not None else [])
    lines = _cmdlines()
    assert all(pid in lines for pid in pids)
    for pid, line in lines.items():
        assert password not in line and quote(password, safe="") not in line, f"pid {pid}: {line}"


def test_the_redis_password_is_on_no_command_line(two_decode: Cluster, tmp_path: Path, tiny_model_dir) -> None:
    password = two_decode.redis.password
    assert password, "the embedded Redis has no password"
    _assert_nowhere_on_a_command_line(two_decode, password)

    with EmbeddedRedis(password="an external/redis password") as external:  # a --redis-url the user gave
        c = start_cluster(parse_up(["--prefill", "0", "--decode", "1", "--port", str(free_base_port()),
                                    "--http-port", "0", "--redis-url", external.url, *tiny_engine_argv(tiny_model_dir),
                                    "--log-dir", str(tmp_path)]))  # fmt: skip
        try:
            _assert_nowhere_on_a_command_line(c, external.password)
        finally:
            discard(c)
