"""The HTTP server under the router's OpenAI-compatible API (``router.openai_api``): uvicorn on the router's own
event loop, beside its gRPC server."""

from __future__ import annotations

import asyncio
import socket
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI


class HttpServer:
    """uvicorn serving an app on the running event loop, beside the gRPC server. The socket is bound before
    uvicorn starts, so a taken port fails here with ``OSError`` and port 0 gets a free one (``port``)."""

    def __init__(self, app: FastAPI, host: str, port: int, tls_cert: str | None = None, tls_key: str | None = None,
                 tls_ca: str | None = None) -> None:  # fmt: skip
        self._socket = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.port = self._socket.getsockname()[1]
        self.scheme = "https" if tls_cert else "http"
        tls = {"ssl_certfile": tls_cert, "ssl_keyfile": tls_key}
        if tls_ca:  # mutual TLS, as on the gRPC port
            tls |= {"ssl_ca_certs": tls_ca, "ssl_cert_reqs": 2}  # ssl.CERT_REQUIRED
        config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False,
                                timeout_graceful_shutdown=30, **(tls if tls_cert else {}))  # fmt: skip
        self._server = _Uvicorn(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start
                raise RuntimeError("the HTTP server stopped during start-up")
            await asyncio.sleep(0.01)

    async def stop(self, grace_s: float = 0.0) -> None:
        """Stop taking connections; open streams get ``grace_s`` seconds, then they are cancelled."""
        self._server.config.timeout_graceful_shutdown = grace_s
        self._server.should_exit = True
        if self._task is not None:
            await self._task


class _Uvicorn(uvicorn.Server):
    @contextmanager
    def capture_signals(self):  # the router's own loop owns SIGINT/SIGTERM
        yield
