"""``router.server``: fail-over to another decode worker before the first token, and the in-flight count of each
choice, with in-process servers on real gRPC loopback. A stream that fails mid-way:
tests/service/test_router_migration.py."""

from __future__ import annotations

import logging

from router_utils import RouterStack, new_router
from service_utils import InProcessServer

from kvserve.client import Client


def test_router_fails_over_to_another_decode_worker(model_dir, caplog):
    """Static decode workers in order: one nothing listens on, one that dies after its health check, a live one.
    The first is never called (its health check fails); the second fails before its first token and the
    request moves on; later requests skip it without trying."""
    stack = RouterStack(model_dir)
    with socket_free_port() as dead_port:  # nothing listens there
        pass
    dying = InProcessServer({"Decode": stack.worker}, aio=stack.aio)  # the same worker on a second port
    router = new_router(model_dir, [f"127.0.0.1:{dead_port}", dying.address, stack.decode.address])
    front = InProcessServer({"Inference": router}, aio=stack.aio)
    options = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
    try:
        with Client(front.address, timeout_s=60) as client:
            assert len(client.generate([5, 6, 7, 8], **options).token_ids) == 3  # served on the second port
            dying.stop()
            with caplog.at_level(logging.WARNING, logger="router.server"):
                for _ in range(2):
                    assert len(client.generate([5, 6, 7, 8], **options).token_ids) == 3
        failovers = [r.getMessage() for r in caplog.records if "failed before its first token" in r.getMessage()]
        assert len(failovers) == 1 and dying.address in failovers[0]  # once: the next request skipped it
        assert sum(router._in_flight.values()) == 0
    finally:
        front.stop()
        stack.aio.run(router.close())
        stack.stop()


class socket_free_port:
    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return self.sock.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self.sock.close()


def test_router_counts_each_choice_as_it_makes_it(model_dir):
    """Requests between two heartbeats: a request ranks the workers and counts its choices with no await in
    between, so 8 requests split 4/4 over two idle workers of each role, and releases undo the counts."""
    from cluster_state.workers import WorkerInfo
    from router.routing import choose

    router = new_router(model_dir, [])
    prefill = [WorkerInfo(worker_id=f"prefill-{i}", role="prefill", address=f"127.0.0.1:{9100 + i}") for i in range(2)]
    decode = [WorkerInfo(worker_id=f"decode-{i}", role="decode", address=f"127.0.0.1:{9200 + i}", free_blocks=100,
                         total_blocks=100) for i in range(2)]  # fmt: skip
    slots = []
    for _ in range(8):
        choice = choose(decode, prefill, {}, 4, router._load, router.weights)
        slots.append((router._claim(choice.prefill), router._claim(choice.decode[0].worker_id)))
    assert sorted(p.key for p, _ in slots) == ["prefill-0"] * 4 + ["prefill-1"] * 4
    assert sorted(d.key for _, d in slots) == ["decode-0"] * 4 + ["decode-1"] * 4
    for p, d in slots:
        p.release()
        d.release()
        d.release()  # harmless
    assert sum(router._in_flight.values()) == 0
