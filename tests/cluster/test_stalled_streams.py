"""Clients that open streams and never read them: the router cancels each stream once its client has read
nothing for the stream idle timeout, which cancels the decode call (freeing its blocks) and the router's
claim on the worker. Without it (``stream_idle_timeout_s = 0``) the HTTP streams stay open for ever, and the
gRPC ones until keepalive gives up on the stopped client (40 s)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys

import grpc
from router_utils import new_router
from service_utils import InProcessServer
from waiting import wait_until

from protos.kvserve.v1 import kvserve_pb2 as pb
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
from router.http_server import HttpServer
from router.openai_api import create_app
from rpc import metrics
from rpc.loop import AsyncioThread

NUM_STREAMS = 200
IDLE_S = 1.0


class _EndlessDecode(pb_grpc.DecodeServicer):
    """Streams 4 KiB of text per token until the call is cancelled; counts open and cancelled calls."""

    def __init__(self) -> None:
        self.open = 0
        self.cancelled = 0

    async def Generate(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext):
        self.open += 1
        try:
            while True:
                yield pb.GenerateResponse(request_id=request.request_id, token_ids=[5], text="x" * 4096)
        finally:
            self.open -= 1
            self.cancelled += 1


_GRPC_CLIENT = """
import sys, time, grpc
from kvserve.client import build_request
from protos.kvserve.v1 import kvserve_pb2_grpc as pb_grpc
stub = pb_grpc.InferenceStub(grpc.insecure_channel(sys.argv[1]))
calls = [stub.Generate(build_request([1, 2, 3], max_tokens=4000, ignore_eos=True)) for _ in range(int(sys.argv[2]))]
for call in calls:
    call.initial_metadata()  # sent with the first message: every stream is flowing
print("started", flush=True)
time.sleep(3600)
"""


def test_streams_nobody_reads_are_cancelled_and_release_the_worker(model_dir):
    aio = AsyncioThread()
    decode = _EndlessDecode()
    decode_server = InProcessServer({"Decode": decode}, aio=aio)
    router = new_router(model_dir, [decode_server.address])
    router.stream_idle_timeout_s = IDLE_S
    front = InProcessServer({"Inference": router}, aio=aio)
    http = HttpServer(create_app(router, "m"), "127.0.0.1", 0)
    aio.run(http.start())
    stalled_before = metrics.STALLED_STREAMS._value.get()
    # a gRPC client that opens its streams, then stops reading altogether (SIGSTOP: nothing reads its socket)
    client = subprocess.Popen([sys.executable, "-c", _GRPC_CLIENT, front.address, str(NUM_STREAMS)],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    sockets = []
    try:
        assert client.stdout.readline().strip() == "started"
        client.send_signal(signal.SIGSTOP)
        body = json.dumps({"model": "m", "prompt": [1, 2, 3], "max_tokens": 4000, "stream": True}).encode()
        for _ in range(10):  # the same over HTTP: a socket that sends its request and never reads the answer
            sock = socket.create_connection(("127.0.0.1", http.port))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
            sockets.append(sock)
        wait_until(lambda: decode.open + decode.cancelled >= NUM_STREAMS + 10, 60, "every stream reaching decode")
        wait_until(lambda: decode.open == 0, 60, "every decode call cancelled")
        assert metrics.STALLED_STREAMS._value.get() - stalled_before == NUM_STREAMS + 10
        wait_until(lambda: sum(router._in_flight.values()) == 0, 10, "the router's claims released")
    finally:
        client.kill()
        client.wait()
        for sock in sockets:
            sock.close()
        aio.run(http.stop())
        front.stop()
        aio.run(router.close())
        decode_server.stop()
        aio.stop()
