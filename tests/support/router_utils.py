"""A router in front of one real decode worker, both served in the test process on real gRPC loopback."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

from service_utils import TEST_SECURITY, InProcessServer

from cluster_state.registry import Registry
from decode_service.worker import DecodeWorker
from engine import LLMEngine
from engine.model_config import ModelConfig
from engine.tokenizer import Tokenizer
from router.server import Router
from rpc.loop import AsyncioThread


def new_router(model_dir, decode_addresses: list[str], registry: Registry | None = None,
               max_model_len: int | None = None) -> Router:  # fmt: skip
    """A router over ``model_dir``'s model; ``max_model_len`` as its flag (default: the model's context)."""
    config = ModelConfig.from_dir(model_dir)
    return Router(Tokenizer(model_dir), config.vocab_size, max_model_len or config.max_context, TEST_SECURITY,
                  registry, decode_addresses)  # fmt: skip


class RouterStack:
    """A decode worker (``num_blocks`` of 16 tokens, local prefill) and a router that knows only it, sharing
    one event-loop thread, both with ``max_model_len`` when given. ``address`` is the router's; ``stop()`` ends
    everything it started."""

    def __init__(self, model_dir, num_blocks: int = 64, max_waiting: int = 64, max_model_len: int | None = None,
                 **engine_options) -> None:  # fmt: skip
        self.aio = AsyncioThread()
        self.engine = LLMEngine(model="default", num_blocks=num_blocks, block_size=16, max_model_len=max_model_len,
                                **engine_options)  # fmt: skip
        self.worker = DecodeWorker(self.engine, "decode-0", "127.0.0.1:0", self.aio, TEST_SECURITY,
                                   max_waiting=max_waiting)  # fmt: skip
        self.worker.loop.start()
        self.decode = InProcessServer({"Decode": self.worker}, aio=self.aio)
        self.router = new_router(model_dir, [self.decode.address], max_model_len=max_model_len)
        self.front = InProcessServer({"Inference": self.router}, aio=self.aio)
        self.address = self.front.address

    def stop(self) -> None:
        self.front.stop()
        self.aio.run(self.router.close())
        self.decode.stop()
        self.worker.stop()
        self.engine.close()
        self.aio.stop()


@contextmanager
def http_stack(model_dir, names: list[str], root: str | None = None, **stack_options) -> Iterator[RouterStack]:
    """A ``RouterStack`` whose router also serves the OpenAI-compatible HTTP API under ``names`` (``root``: what
    ``/v1/models`` reports), at ``stack.http_url``."""
    from router.http_server import HttpServer  # fastapi and uvicorn: only for the HTTP API
    from router.openai_api import create_app

    stack = RouterStack(model_dir, **stack_options)
    http = HttpServer(create_app(stack.router, names, **({"root": root} if root else {})), "127.0.0.1", 0)
    stack.aio.run(http.start())
    stack.http_url = f"http://127.0.0.1:{http.port}"
    try:
        yield stack
    finally:
        stack.aio.run(http.stop())
        stack.stop()


def openai_client(stack: RouterStack):
    import openai

    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post_json(stack: RouterStack, path: str, body: dict) -> tuple[int, dict]:
    """(HTTP status, JSON reply) of POSTing ``body`` to the stack's HTTP API, error statuses included."""
    request = urllib.request.Request(stack.http_url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
