"""Streams whose reader stopped reading.

A server-streaming call's messages wait in the connection's flow-control window, then in the server's own
buffers, for as long as the client does not read them: a client that opens streams and never reads holds
their memory, their decode worker's blocks and the router's concurrency slots for ever (until keepalive
finds a dead peer, which a live one that merely never reads is not). ``cancel_when_stalled`` puts a limit
on it: when the consumer has not come back for the next message ``limit_s`` after taking one (it is stuck
writing it to the client), the consuming task is cancelled, which ends the call and, through the stream's
own cleanup, frees what it holds. Time spent waiting for the next token does not count.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TypeVar

from rpc import metrics

log = logging.getLogger(__name__)
_T = TypeVar("_T")


async def cancel_when_stalled(stream: AsyncGenerator[_T, None], limit_s: float, what: str) -> AsyncIterator[_T]:
    """``stream``'s items; cancels the task consuming them when one is not written out within ``limit_s``
    (``0``: no limit). ``what`` names the stream in the log."""
    if limit_s <= 0:
        async for item in stream:
            yield item
        return
    consumer = asyncio.current_task()
    loop = asyncio.get_running_loop()

    def stalled() -> None:
        log.warning("%s: the client read nothing for %.0f s; cancelling the stream", what, limit_s)
        metrics.STALLED_STREAMS.inc()
        # ``stream`` is suspended (it gave us the item the consumer is stuck writing): close it here, since a
        # cancelled consumer may drop this generator without closing it, and the stream's cleanup is what
        # frees the call and its blocks; then end the consumer's call
        asyncio.ensure_future(stream.aclose())
        consumer.cancel()

    async for item in stream:
        timer = loop.call_later(limit_s, stalled)
        try:
            yield item  # resumed once the consumer wrote it out and wants the next
        finally:
            timer.cancel()
