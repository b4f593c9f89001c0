"""The router's OpenAI-compatible HTTP API through the official ``openai`` client: the same greedy text as the
gRPC door (same router, same decode worker), streaming and not; usage; error objects and their HTTP status
codes; and a client that disconnects mid-stream gets its blocks freed."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from router_utils import RouterStack, new_router
from waiting import wait_until

from kvserve.client import Client
from router.http_server import HttpServer
from router.openai_api import create_app

PROMPT = "The three most useful things to know about Paris are"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
MODEL = "SmolLM2-135M-Instruct"
NUM_BLOCKS = 64  # of 16 tokens


def _serve_http(stack: RouterStack, router) -> HttpServer:
    http = HttpServer(create_app(router, MODEL), "127.0.0.1", 0)
    stack.aio.run(http.start())
    return http


@pytest.fixture(scope="module")
def stack(model_dir):
    s = RouterStack(model_dir, num_blocks=NUM_BLOCKS, max_waiting=1)
    http = _serve_http(s, s.router)
    s.http_url = f"http://127.0.0.1:{http.port}"
    yield s
    s.aio.run(http.stop())
    s.stop()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _http(url: str, body: dict | None = None) -> tuple[int, dict]:
    """(status, JSON body) of a GET, or of a POST of ``body``."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _wait_all_free(stack: RouterStack, timeout_s: float = 60) -> None:
    wait_until(lambda: stack.engine.block_manager.num_free_blocks == NUM_BLOCKS, timeout_s, "every block freed")


def test_greedy_completion_equals_the_grpc_path(stack, client):
    with Client(stack.address, timeout_s=120) as grpc_client:
        expected = grpc_client.generate(PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    assert whole.choices[0].text == expected.text
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12
    assert whole.usage.prompt_tokens == expected.usage["prompt_tokens"]
    assert whole.usage.prompt_tokens_details.cached_tokens == expected.usage["cached_prompt_tokens"]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-2].choices[0].finish_reason == "length"


def test_greedy_chat_equals_the_grpc_path(stack, client):
    with Client(stack.address, timeout_s=120) as grpc_client:
        expected = grpc_client.generate(CHAT, max_tokens=10, temperature=0)
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=10, temperature=0)
    assert whole.choices[0].message.content == expected.text
    assert whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert all(c.usage is None for c in chunks)  # usage only when stream_options asks


def test_stop_string_and_models_and_health(stack, client):
    whole = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[" 6"])
    assert " 6" not in whole.choices[0].text and whole.choices[0].finish_reason == "stop"
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert _http(stack.http_url + "/health") == (200, {"status": "ok"})


@pytest.mark.parametrize("body, param_hint", [
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "max_tokens": 100000}, "context"),
    ({"prompt": "hi", "n": 17}, "n must be an integer in [1, 16]"),
    ({"prompt": []}, "prompt is an empty list"),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "hi", "top_k": 1 << 40}, "range"),
    ({"prompt": "hi", "priority": 1 << 31}, "priority must be an integer in [-2147483648, 2147483647]"),
    ({"prompt": "hi", "priority": -(1 << 40)}, "priority must be an integer"),
])  # fmt: skip
def test_bad_input_is_400_with_an_openai_error_object(stack, body, param_hint):
    status, reply = _http(stack.http_url + "/v1/completions", {"model": MODEL, **body})
    assert status == 400
    error = reply["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_argument"
    assert param_hint in error["message"]


def test_bad_chat_role_is_400_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "hi"}])
    assert "role" in err.value.body["message"]


def test_no_decode_worker_is_503(stack, model_dir):
    router = new_router(model_dir, [])
    http = _serve_http(stack, router)
    try:
        url = f"http://127.0.0.1:{http.port}"
        assert _http(url + "/health")[0] == 503
        with pytest.raises(openai.APIStatusError) as err:
            openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).completions.create(
                model=MODEL, prompt="hi", max_tokens=2, stream=True)  # fmt: skip
        assert err.value.status_code == 503 and err.value.body["code"] == "unavailable"
    finally:
        stack.aio.run(http.stop())
        stack.aio.run(router.close())


def test_full_worker_is_429(stack, client):
    """64 blocks: one request holds 57 and grows, a second waits for blocks (the queue limit is 1), a third is 429."""
    holder = client.completions.create(model=MODEL, prompt=list(range(100, 1000)), max_tokens=100, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    next(iter(holder))  # running: 900 prompt tokens in 57 blocks, 63 by its end
    waiter = threading.Thread(target=lambda: client.completions.create(model=MODEL, prompt=list(range(400, 520)),
                                                                       max_tokens=2, temperature=0))  # fmt: skip
    waiter.start()
    time.sleep(0.5)
    try:
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert err.value.body["code"] == "resource_exhausted"
    finally:
        holder.close()
        waiter.join(timeout=60)
    _wait_all_free(stack)


def test_disconnect_mid_stream_frees_the_blocks(stack):
    body = (b'{"model": "' + MODEL.encode() + b'", "prompt": [' + b",".join(str(i).encode() for i in range(100, 180))
            + b'], "max_tokens": 900, "temperature": 0, "ignore_eos": true, "stream": true}')  # fmt: skip
    port = int(stack.http_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        received = b""
        while received.count(b"data: ") < 2:  # two tokens streamed: it is running, holding its blocks
            received += conn.recv(4096)
        assert b" 200 " in received.split(b"\r\n")[0]
        assert stack.engine.block_manager.num_free_blocks < NUM_BLOCKS
    # 900 tokens take over 10 s here; the blocks come back at once because the request was cancelled
    _wait_all_free(stack, timeout_s=5)
