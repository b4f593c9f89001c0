"""``kvserve.launcher.supervisor`` over real processes (no model, no cluster): restarts with backoff, giving up on what
keeps crashing (and failing the cluster only when its minimum is gone), removing a dead decode worker's pool
file, and counting a child as serving only when the child itself answers: a real process that holds the
child's port and answers every gRPC health check with SERVING never passes for it (real gRPC on loopback)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from cluster_utils import supervising
from waiting import wait_until

from kvserve.launcher.processes import Child
from kvserve.launcher.supervisor import ClusterFailed, RestartPolicy, State, Supervisor
from kvstore.shared_pool import SHM_DIR_ENV, pool_file_name
from security.auth import Security

# The child: a gRPC server set up exactly as every kvserve process sets up its own (rpc.server).
CHILD = """
import asyncio, sys
from security.auth import Security
from rpc.server import new_server, start_server

async def main():
    server = new_server(Security(None))
    await start_server(server, [], sys.argv[1], Security(None))
    await server.wait_for_termination()

asyncio.run(main())
"""

# Another program on the child's port: it answers SERVING to every health check, whatever service it names.
IMPOSTOR = """
import sys
from concurrent import futures
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

class AlwaysServing(health_pb2_grpc.HealthServicer):
    def Check(self, request, context):
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

server = grpc.server(futures.ThreadPoolExecutor(2), options=[("grpc.so_reuseport", 0)])
health_pb2_grpc.add_HealthServicer_to_server(AlwaysServing(), server)
server.add_insecure_port(sys.argv[1])
server.start()
print("listening", flush=True)
server.wait_for_termination()
"""

POLICY = RestartPolicy(initial_delay_s=0.1, max_delay_s=0.4, max_start_failures=1000, startup_timeout_s=60.0,
                       tick_s=0.05)  # fmt: skip
NOWHERE = "127.0.0.1:1"  # a stand-in's address: it never answers a health check


def _free_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


@pytest.fixture
def start_child(tmp_path):
    """Start a real process as a cluster child: ``python -c code *args``; every one is killed after the test."""
    started: list[Child] = []

    def start(name: str, role: str, code: str, *args: str, address: str = NOWHERE, **env: str) -> Child:
        child = Child(name, role, address, [sys.executable, "-c", code, *args], {**os.environ, **env},
                      Security(None), tmp_path / f"{name}.log")  # fmt: skip
        child.start()
        started.append(child)
        return child

    yield start
    for child in started:
        child.kill()
        if child.proc is not None:
            child.proc.wait()


def test_a_process_on_the_childs_port_that_answers_serving_is_not_taken_for_the_child(start_child):
    address = _free_address()
    impostor = subprocess.Popen([sys.executable, "-c", IMPOSTOR, address], stdout=subprocess.PIPE, text=True)
    try:
        assert impostor.stdout.readline().strip() == "listening"
        child = start_child("prefill-0", "prefill", CHILD, address, address=address)
        with supervising([child], POLICY) as (supervisor, messages):
            # Each start of the real child fails to bind the port the impostor holds, and each death says why.
            wait_until(lambda: _count(messages, "restarting it in") >= 3, 60, "three deaths of the child")
            assert not child.answers(timeout_s=1.0)  # the impostor answers SERVING, but cannot prove it is the child
            assert _count(messages, "serves again") == 0, messages
            assert supervisor.state("prefill-0") is not State.UP
            deaths = [line for line in messages if "restarting it in" in line]
            assert all("another process holds its port (Address already in use)" in line for line in deaths), deaths

            impostor.send_signal(signal.SIGTERM)
            impostor.wait(timeout=10)
            # Once the port is free the child's next start serves, and is counted as serving again.
            wait_until(lambda: _count(messages, "serves again") == 1, 60, "the child serving once the port is free")
            assert supervisor.state("prefill-0") is State.UP and child.answers(timeout_s=1.0)
    finally:
        impostor.kill()
        impostor.wait()
        impostor.stdout.close()


def test_a_child_answers_only_for_its_own_start(start_child):
    """A restart gets a new instance id: the process of an earlier start can no longer pass for the child."""
    address = _free_address()
    child = start_child("decode-0", "decode", CHILD, address, address=address)
    first = child.proc
    try:
        wait_until(lambda: child.answers(timeout_s=1.0), 60, "the child answering")
        child.start()  # a second start while the first process still holds the port: it cannot bind
        assert child.proc.wait(timeout=60) != 0
        assert first.poll() is None and not child.answers(timeout_s=1.0)
    finally:
        first.kill()
        first.wait()


def test_gives_up_on_a_decode_worker_that_keeps_crashing_after_backing_off(start_child):
    crashing = start_child("decode-0", "decode", "import sys; sys.exit(3)")
    policy = RestartPolicy(initial_delay_s=0.05, max_delay_s=0.2, max_start_failures=3, tick_s=0.02)
    started = time.monotonic()
    with pytest.raises(ClusterFailed, match="no decode worker can be kept running"):
        Supervisor([crashing], policy).run(threading.Event())
    # backoff 0.05 + 0.1 + 0.2 + 0.2 s between the initial run and 4 failed restarts
    assert time.monotonic() - started >= 0.55


def test_keeps_serving_without_a_prefill_worker_that_keeps_crashing(start_child):
    decode = start_child("decode-0", "decode", "import time; time.sleep(60)")
    prefill = start_child("prefill-0", "prefill", "import sys; sys.exit(3)")
    supervisor = Supervisor([decode, prefill], RestartPolicy(initial_delay_s=0.01, max_delay_s=0.01,
                                                             max_start_failures=2, tick_s=0.02))  # fmt: skip
    stop = threading.Event()
    timer = threading.Timer(1.5, stop.set)
    timer.start()
    supervisor.run(stop)  # returns when stopped, not with ClusterFailed
    assert supervisor.state("prefill-0") is State.ABANDONED and supervisor.state("decode-0") is State.UP


# A decode worker's stand-in: makes its pool file where its environment says, as a real one does, and lives on.
POOL_MAKER = """
import os, pathlib, sys, time
from kvstore.shared_pool import SHM_DIR_ENV, pool_file_name
(pathlib.Path(os.environ[SHM_DIR_ENV]) / pool_file_name(sys.argv[1], os.getpid())).touch()
time.sleep(60)
"""


def test_a_dead_decode_workers_pool_file_is_removed_before_its_restart(start_child, tmp_path):
    pools = tmp_path / "pools"
    pools.mkdir()
    decode = start_child("decode-0", "decode", POOL_MAKER, "decode-0", **{SHM_DIR_ENV: str(pools)})
    first = decode.pid
    wait_until(lambda: (pools / pool_file_name("decode-0", first)).exists(), 30, "the first pool file")
    with supervising([decode], POLICY) as (_, messages):
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: decode.pid != first and (pools / pool_file_name("decode-0", decode.pid)).exists(), 30,
                   "the restarted worker's pool file")  # fmt: skip
        assert [path.name for path in pools.iterdir()] == [pool_file_name("decode-0", decode.pid)]
    assert any(f"decode decode-0 (pid {first}) killed by SIGKILL; restarting it in" in m for m in messages), messages


def _count(messages: list[str], text: str) -> int:
    return sum(text in line for line in list(messages))
