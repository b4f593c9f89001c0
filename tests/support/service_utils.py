"""Serving kvserve services in the test process: a grpc.aio server on its own event-loop thread."""

from __future__ import annotations

from rpc.loop import AsyncioThread
from rpc.server import add_service, new_server, start_server
from security.auth import Security

TEST_SECURITY = Security(token="test-cluster-token")


class InProcessServer:
    """``services`` ({"Decode": servicer, ...}) on 127.0.0.1 at a free port, on ``aio`` (a new loop thread when
    None). ``address`` is where to dial; ``stop()`` ends the server (and the loop thread if it made it), once."""

    def __init__(self, services: dict[str, object], security: Security = TEST_SECURITY,
                 aio: AsyncioThread | None = None) -> None:  # fmt: skip
        self._own_loop = aio is None
        self.aio = aio or AsyncioThread()

        async def start():
            server = new_server(security)
            names = [add_service(server, name, servicer) for name, servicer in services.items()]
            port, _ = await start_server(server, names, "127.0.0.1:0", security)
            return server, port

        self.server, port = self.aio.run(start())
        self.address = f"127.0.0.1:{port}"
        self._stopped = False

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.aio.run(self.server.stop(0))
        if self._own_loop:
            self.aio.stop()
