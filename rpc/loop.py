"""The engine loop of a worker process, and the asyncio thread its gRPC server runs on."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

_T = TypeVar("_T")


class Loop:
    """Calls ``body`` over and over until ``stop``: on the calling thread (``run``) or on a new one (``start``).

    Worker processes ``run`` their engine loop on the main thread. PyTorch's CPU
    ops run on OpenMP, which keeps a separate thread pool for every thread that
    calls it; the main thread already owns one from loading the model, and as
    soon as a second exists on a machine with few cores, libgomp stops idle pool
    threads from spinning, so every parallel op waits for a wake-up (measured
    here on 2 cores: elementwise ops 2.5x slower, a 256-token prefill ~15% slower
    on a second thread). The gRPC threads stay off OpenMP for the same reason.
    """

    def __init__(self, body: Callable[[], None], name: str) -> None:
        self._body = body
        self._name = name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._hooks: list[Callable[[], None]] = []

    def add_hook(self, hook: Callable[[], None]) -> None:
        """Also call ``hook()`` after every ``body()``, on the loop's thread (e.g. to hand off engine events)."""
        self._hooks.append(hook)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def run(self) -> None:
        while not self._stop.is_set():
            self._body()
            for hook in self._hooks:
                hook()

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=self._name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


class AsyncioThread:
    """An asyncio event loop on a daemon thread: where a worker's ``grpc.aio`` server and its client calls live,
    while the main thread runs the engine loop. ``run(coro)`` runs a coroutine there and waits for its result;
    ``submit(coro)`` returns a ``concurrent.futures.Future`` at once."""

    def __init__(self, name: str = "grpc-aio") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, _T]):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, _T], timeout_s: float | None = None) -> _T:
        return self.submit(coro).result(timeout=timeout_s)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop's thread (thread-safe; never blocks the caller)."""
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
