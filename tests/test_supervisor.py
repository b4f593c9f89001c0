"""The supervisor counts a child as serving only when the child itself answers: a real process that holds the
child's port and answers every gRPC health check with SERVING never passes for it. Real processes, real gRPC
over loopback."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading

import pytest
from waiting import wait_until

from kvserve.cluster import Cluster
from kvserve.processes import Child
from kvserve.supervisor import RestartPolicy, State, Supervisor
from rpc.auth import Security

# The child: a gRPC server set up exactly as every kvserve process sets up its own (rpc.server).
CHILD = """
import asyncio, sys
from rpc.auth import Security
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


def _free_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def count(self, text: str) -> int:
        return sum(text in line for line in list(self.lines))


@pytest.fixture
def messages():
    handler, logger = _Messages(), logging.getLogger("kvserve.supervisor")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_a_process_on_the_childs_port_that_answers_serving_is_not_taken_for_the_child(tmp_path, messages):
    address = _free_address()
    impostor = subprocess.Popen([sys.executable, "-c", IMPOSTOR, address], stdout=subprocess.PIPE, text=True)
    assert impostor.stdout.readline().strip() == "listening"
    child = Child("prefill-0", "prefill", address, [sys.executable, "-c", CHILD, address], dict(os.environ),
                  Security(None), tmp_path / "prefill-0.log")  # fmt: skip
    child.start()
    cluster = Cluster("127.0.0.1:1", "", tmp_path / "pools", Security(None), stop_timeout_s=5.0, children=[child])
    supervisor, stop = Supervisor(cluster, POLICY), threading.Event()
    thread = threading.Thread(target=supervisor.run, args=(stop,), name="supervisor")
    thread.start()
    try:
        # Each start of the real child fails to bind the port the impostor holds, and each death says why.
        wait_until(lambda: messages.count("restarting it in") >= 3, 60, "three deaths of the child")
        assert not child.answers(timeout_s=1.0)  # the impostor answers SERVING, but cannot prove it is the child
        assert messages.count("serves again") == 0, messages.lines
        assert supervisor.state("prefill-0") is not State.UP
        deaths = [line for line in messages.lines if "restarting it in" in line]
        assert all("another process holds its port (Address already in use)" in line for line in deaths), deaths

        impostor.send_signal(signal.SIGTERM)
        impostor.wait(timeout=10)
        # Once the port is free the child's next start serves, and is counted as serving again.
        wait_until(lambda: messages.count("serves again") == 1, 60, "the child serving once the port is free")
        assert supervisor.state("prefill-0") is State.UP and child.answers(timeout_s=1.0)
    finally:
        stop.set()
        thread.join()
        cluster.stop()
        impostor.kill()
        impostor.wait()
        impostor.stdout.close()


def test_a_child_answers_only_for_its_own_start(tmp_path):
    """A restart gets a new instance id: the process of an earlier start can no longer pass for the child."""
    address = _free_address()
    child = Child("decode-0", "decode", address, [sys.executable, "-c", CHILD, address], dict(os.environ),
                  Security(None), tmp_path / "decode-0.log")  # fmt: skip
    child.start()
    first = child.proc
    try:
        wait_until(lambda: child.answers(timeout_s=1.0), 60, "the child answering")
        child.start()  # a second start while the first process still holds the port: it cannot bind
        assert child.proc.wait(timeout=60) != 0
        assert first.poll() is None and not child.answers(timeout_s=1.0)
    finally:
        first.kill()
        first.wait()
