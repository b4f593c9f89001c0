"""The router's front door (``router.limits``) on a real ``python -m router`` process in front of a real decode
worker, over loopback: the API key on both doors, the request size on both doors (a 50 MB body is refused
before it is read, while other requests are served), the concurrency limit across both doors, and
``/metrics`` on its own port."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
from router_utils import RouterStack
from service_utils import TEST_SECURITY
from waiting import wait_until

from kvserve.client import Client
from rpc.requests import API_KEY_ENV
from rpc.server import wait_healthy
from security.auth import TOKEN_ENV

KEY = "front-door-test-key"
MAX_CONCURRENT = 2
MAX_BYTES = 4 << 20  # the default --max-request-bytes
MODEL = "SmolLM2-135M-Instruct"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RouterProcess:
    def __init__(self, decode_address: str) -> None:
        self.grpc_port, self.http_port, self.metrics_port = _free_port(), _free_port(), _free_port()
        self.address = f"127.0.0.1:{self.grpc_port}"
        self.url = f"http://127.0.0.1:{self.http_port}"
        env = {**os.environ, TOKEN_ENV: TEST_SECURITY.token, API_KEY_ENV: KEY}  # the key never on a command line
        cmd = [sys.executable, "-m", "router", "--port", str(self.grpc_port), "--http-port", str(self.http_port),
               "--metrics-port", str(self.metrics_port), "--decode-address", decode_address,
               "--max-concurrent-requests", str(MAX_CONCURRENT)]  # fmt: skip
        self.proc = subprocess.Popen(cmd, env=env, cwd=Path(__file__).parents[2])
        wait_until(self._serving, 120, "the router serving", interval_s=0.2)

    def _serving(self) -> bool:
        assert self.proc.poll() is None, "the router exited during start-up"
        return _get(self.url + "/health")[0] == 200

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def stack(model_dir):
    s = RouterStack(model_dir, num_blocks=256)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def router(stack, monkeypatch_module):
    monkeypatch_module.delenv(API_KEY_ENV, raising=False)  # clients here send a key only when told to
    r = RouterProcess(stack.decode.address)
    yield r
    r.stop()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _get(url: str, key: str | None = None) -> tuple[int, bytes, dict]:
    return _http(url, None, key)


def _http(url: str, body: dict | None, key: str | None = None) -> tuple[int, bytes, dict]:
    """(status, body, headers) of a GET, or of a POST of ``body``; (0, b"", {}) when nothing listens."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, None if body is None else json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, reply.read(), dict(reply.headers)
    except urllib.error.HTTPError as err:
        return err.code, err.read(), dict(err.headers)
    except (urllib.error.URLError, ConnectionError):
        return 0, b"", {}


def _openai(router: RouterProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0, timeout=120)


def _complete(router: RouterProcess) -> str:
    reply = _openai(router, KEY).completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                                    temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    return reply.choices[0].text


def test_grpc_wants_the_api_key(router, stack):
    for key in ("", "wrong-key"):
        with Client(router.address, timeout_s=60, api_key=key) as client, pytest.raises(grpc.RpcError) as err:
            client.generate("hi", max_tokens=2)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "Authorization: Bearer" in err.value.details()
    with Client(router.address, timeout_s=60, api_key=KEY) as client:
        served = client.generate("The capital of France is", max_tokens=6, temperature=0, ignore_eos=True)
    with Client(stack.address, timeout_s=60) as client:  # the in-process router, which wants no key
        expected = client.generate("The capital of France is", max_tokens=6, temperature=0, ignore_eos=True)
    assert served.text == expected.text and served.finish_reason == "length"
    assert wait_healthy(router.address, 5.0)  # health checks need no key


def test_http_wants_the_api_key_except_for_health(router):
    for key in (None, "wrong-key"):
        status, body, headers = _http(router.url + "/v1/completions", {"model": MODEL, "prompt": "hi"}, key)
        assert status == 401 and headers.get("www-authenticate") == "Bearer"
        error = json.loads(body)["error"]
        assert error["code"] == "unauthenticated" and "Authorization: Bearer" in error["message"]
        assert _get(router.url + "/v1/models", key)[0] == 401
    assert _get(router.url + "/health")[0] == 200
    with pytest.raises(openai.AuthenticationError):
        _openai(router, "wrong-key").completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert _complete(router)
    assert [m.id for m in _openai(router, KEY).models.list().data] == [MODEL]


def test_metrics_are_served_on_their_own_port_only(router):
    status, body, _ = _get(f"http://127.0.0.1:{router.metrics_port}/metrics")
    assert status == 200 and b"kvserve_router_refused_total" in body
    assert _get(router.url + "/metrics", KEY)[0] == 404


def _connect(router: RouterProcess, headers: str, first_bytes: bytes) -> socket.socket:
    """A POST to /v1/completions with ``headers``, of which ``first_bytes`` are sent (with the headers)."""
    conn = socket.create_connection(("127.0.0.1", router.http_port), timeout=30)
    conn.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                 f"Content-Type: application/json\r\n{headers}\r\n".encode() + first_bytes)  # fmt: skip
    return conn


def _reply(conn: socket.socket) -> tuple[bytes, bytes]:
    """(status line, body) of the one response on ``conn``, read until the server closes the connection."""
    data = b""
    try:
        while chunk := conn.recv(65536):
            data += chunk
    except ConnectionResetError:  # it closed with our unread bytes in its buffer: the answer came first
        pass
    head, _, body = data.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0], body


def _send_until_refused(conn: socket.socket, data: bytes, chunk: int = 1 << 20) -> int:
    """Send ``data`` in chunks until the server stops taking it; the bytes sent."""
    sent = 0
    try:
        while sent < len(data):
            conn.sendall(data[sent : sent + chunk])
            sent += chunk
    except OSError:  # the server closed the connection
        pass
    return min(sent, len(data))


def test_a_declared_50_MB_body_gets_413_and_is_never_read(router):
    body = b'{"model": "m", "max_tokens": 2, "prompt": "' + b"a" * 50_000_000 + b'"}'
    with _connect(router, f"Content-Length: {len(body)}\r\n", body[: 16 << 10]) as conn:
        assert _complete(router)  # meanwhile the router serves others
        status, reply = _reply(conn)  # answered and closed while 49.98 MB are still unsent
        assert status.startswith(b"HTTP/1.1 413 ")
        error = json.loads(reply)["error"]
        assert error["code"] == "resource_exhausted" and "--max-request-bytes" in error["message"]
        assert _send_until_refused(conn, body[16 << 10 :]) < 40_000_000  # the rest is refused, not read


def test_a_chunked_body_is_cut_off_at_the_limit(router):
    """No Content-Length: the bytes are counted as they come, and the server answers before the body ends."""
    piece = 1 << 20
    chunk = b"%x\r\n%s\r\n" % (piece, b"a" * piece)
    with _connect(router, "Transfer-Encoding: chunked\r\n", b'10\r\n{"prompt": "aaaa\r\n' + chunk) as conn:
        assert _complete(router)  # a body being read stalls nobody
        num_sent = 1
        while num_sent < 50 and not select.select([conn], [], [], 0)[0]:
            try:
                conn.sendall(chunk)
            except OSError:
                break
            num_sent += 1
            time.sleep(0.01)  # lets the answer arrive before the socket buffers hide it
        assert num_sent < 50, "the server read 50 MiB of body without answering"
        status, reply = _reply(conn)
        assert status.startswith(b"HTTP/1.1 413 ")
        assert json.loads(reply)["error"]["code"] == "resource_exhausted"
    assert _complete(router)


def test_a_grpc_message_over_the_limit_is_resource_exhausted(router):
    with Client(router.address, timeout_s=60, api_key=KEY) as client, pytest.raises(grpc.RpcError) as err:
        client.generate("a" * (MAX_BYTES + 1), max_tokens=1)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in err.value.details()


def test_concurrency_limit_spans_both_doors(router):
    """Two streams in flight (one per door) fill the limit: a third gets 429 / RESOURCE_EXHAUSTED, with the flag
    to raise in its message, while /health and /v1/models still answer; once they end, requests are served."""
    long = {"model": MODEL, "prompt": "Count:", "max_tokens": 4000, "temperature": 0, "stream": True,
            "extra_body": {"ignore_eos": True}}  # fmt: skip
    http_stream = _openai(router, KEY).completions.create(**long)
    next(iter(http_stream))
    grpc_client = Client(router.address, timeout_s=120, api_key=KEY)
    grpc_stream = grpc_client.stream("Count:", max_tokens=4000, temperature=0, ignore_eos=True)
    next(grpc_stream)
    try:
        with pytest.raises(openai.RateLimitError) as err:
            _openai(router, KEY).completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert err.value.body["code"] == "resource_exhausted"
        assert "--max-concurrent-requests" in err.value.body["message"]
        with Client(router.address, timeout_s=60, api_key=KEY) as client, pytest.raises(grpc.RpcError) as failed:
            client.generate("hi", max_tokens=2)
        assert failed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limit of 2 concurrent requests" in failed.value.details()
        assert _get(router.url + "/health")[0] == 200 and _get(router.url + "/v1/models", KEY)[0] == 200
    finally:
        http_stream.close()
        grpc_stream.close()
        grpc_client.close()

    def served() -> bool:
        try:
            assert _complete(router)
        except openai.RateLimitError:
            return False
        return True

    # the router notices the two clients leave within moments
    wait_until(served, 30, "the slots of closed streams given back", interval_s=0.1)
