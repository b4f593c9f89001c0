"""The OpenAI answer of a completions or chat request, assembled from its router streams.

A request is one router stream per prompt (completions may send a list of prompts; chat has one), each with
``n`` choices whose messages interleave, told apart by ``GenerateResponse.index``. Choice ``i * n + j`` of the
answer is prompt i's choice j, as OpenAI numbers them. ``merged`` reads the streams concurrently as one;
``collect`` builds the whole answer (``stream`` false), ``events`` its server-sent events: one chunk per
message with its choice's index (chat's first delta of each choice carries the role), then the usage event when
asked, then ``data: [DONE]``. Usage adds up every stream's last message: each prompt once, every choice's
completion tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from protos.kvserve.v1 import kvserve_pb2 as pb
from router import openai_protocol as api
from router.openai_logprobs import Choice, TokenText
from router.openai_tools import Call, ToolPlan, parse
from router.server import RouteError
from router.tool_call_stream import ToolCallStream


class Choices:
    """The answer's choices, each made when its first message arrives: its text and log-probabilities
    (``Choice``), and how it finished."""

    def __init__(self, chat: bool, text_of: TokenText, logprobs: bool, echoes: list[str | None], n: int,
                 tools: Tools | None = None) -> None:  # fmt: skip
        self.chat, self.n, self.tools = chat, n, tools
        self._text_of, self._logprobs, self._echoes = text_of, logprobs, echoes
        self._tool_streams: dict[int, ToolCallStream] = {}
        self._choices: dict[int, Choice] = {}
        self.texts: dict[int, list[str]] = {}
        self.pieces: dict[int, list[dict[str, Any] | None]] = {}
        self.finish_reasons: dict[int, str | None] = {}
        self.usages: list[pb.Usage] = []

    def piece(self, prompt: int, msg: pb.GenerateResponse) -> tuple[int, str, dict[str, Any] | None, bool]:
        """(choice index, text, log-probabilities, whether it is the choice's first) of prompt ``prompt``'s
        ``msg``; keeps them for ``body``."""
        index = prompt * self.n + msg.index
        first = index not in self._choices
        if first:
            self._choices[index] = Choice(self.chat, self._text_of, self._logprobs, self._echoes[prompt])
            self.texts[index], self.pieces[index] = [], []
        text, logprobs = self._choices[index].piece(msg)
        self.texts[index].append(text)
        self.pieces[index].append(logprobs)
        self.finish_reasons[index] = msg.finish_reason or None
        if msg.HasField("usage"):
            self.usages.append(msg.usage)
        return index, text, logprobs, first

    def body(self) -> list[dict[str, Any]]:
        """Every choice of the whole answer, by index."""
        return [self._body(i) for i in sorted(self._choices)]

    def _body(self, i: int) -> dict[str, Any]:
        text, finish_reason = "".join(self.texts[i]), self.finish_reasons[i]
        logprobs = self._choices[i].join(self.pieces[i])
        if not self.chat:
            return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.tools is not None:
            message["content"], calls = self.tools.parse(text)
            if calls:
                message["tool_calls"] = [call.body() for call in calls]
            finish_reason = self.tools.finish_reason(finish_reason, calls)
        return {"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def delta(self, index: int, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A streamed chat piece of choice ``index`` as (delta without the role, finish_reason): its content and,
        with tools, its tool-call deltas (``router.openai_tools.ToolCallStream``)."""
        if self.tools is None:
            return {"content": text}, finish_reason
        stream = self._tool_streams.setdefault(index, self.tools.stream())
        content, calls = stream.feed(text)
        if finish_reason is not None:
            rest, more = stream.finish()
            content, calls = content + rest, calls + more
            finish_reason = self.tools.finish_reason(finish_reason, stream.calls)
        return {"content": content} | ({"tool_calls": calls} if calls else {}), finish_reason

    def usage(self) -> dict[str, Any]:
        """Every prompt's tokens once, every choice's completion tokens."""
        prompt = sum(u.prompt_tokens for u in self.usages)
        completion = sum(u.completion_tokens for u in self.usages)
        cached = sum(u.cached_prompt_tokens for u in self.usages)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip


@dataclass(frozen=True)
class Tools:
    """How a chat request's answers are read as tool calls: its ``ToolPlan`` and the model's call format."""

    plan: ToolPlan
    fmt: str

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        return parse(self.plan.mode, self.fmt, text, self.plan.name, self.plan.parallel)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self.plan.mode, self.fmt, self.plan.name, self.plan.parallel)

    def finish_reason(self, finish_reason: str | None, calls: list[Call]) -> str | None:
        """"tool_calls" where an answer that stopped made calls it chose (auto, required)."""
        chose = self.plan.mode in ("auto", "required") and calls
        return "tool_calls" if chose and finish_reason == "stop" else finish_reason


async def merged(streams: list[AsyncIterator[pb.GenerateResponse]]) -> AsyncIterator[tuple[int, pb.GenerateResponse]]:
    """(prompt, message) of every stream's messages as they come; the first ``RouteError`` ends it. Closing it
    closes every stream (which cancels their decode calls)."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as stream:
            async for msg in stream:
                yield 0, msg
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(prompt: int, stream: AsyncIterator[pb.GenerateResponse]) -> None:
        try:
            async with aclosing(stream):
                async for msg in stream:
                    queue.put_nowait((prompt, msg))
            queue.put_nowait((prompt, None))
        except Exception as err:  # noqa: BLE001 - a RouteError, or anything else: the consumer raises it
            queue.put_nowait((prompt, err))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            prompt, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                left -= 1
            else:
                yield prompt, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(stream: AsyncIterator[tuple[int, pb.GenerateResponse]], choices: Choices) -> None:
    async for prompt, msg in stream:
        choices.piece(prompt, msg)


def completion(request_id: str, model: str, choices: Choices) -> dict[str, Any]:
    """The whole answer (``stream`` false)."""
    return {"id": request_id, "object": "chat.completion" if choices.chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices.body(),
            "usage": choices.usage()}  # fmt: skip


def chunk(request_id: str, model: str, chat: bool, choices: list[dict[str, Any]],
          usage: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """One streamed event; with ``usage``, the closing usage event (no choices), as OpenAI sends it."""
    body = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices}  # fmt: skip
    if usage is not None:
        body["usage"] = usage
    return body


def chunk_choice(choices: Choices, index: int, text: str, finish_reason: str | None, first: bool,
                 logprobs: dict[str, Any] | None) -> dict[str, Any]:  # fmt: skip
    if choices.chat:
        delta, finish_reason = choices.delta(index, text, finish_reason)
        delta = ({"role": "assistant"} if first else {}) | delta
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


async def events(stream: AsyncIterator[tuple[int, pb.GenerateResponse]], first: tuple[int, pb.GenerateResponse] | None,
                 request_id: str, model: str, choices: Choices, include_usage: bool) -> AsyncIterator[str]:  # fmt: skip
    """SSE events: one per router message, the usage event when asked, ``[DONE]``. Starlette cancels this
    generator when the client disconnects; closing ``stream`` then cancels the decode calls."""
    chat = choices.chat
    async with aclosing(stream):
        item = first
        try:
            while item is not None:
                prompt, msg = item
                index, text, logprobs, is_first = choices.piece(prompt, msg)
                body = chunk_choice(choices, index, text, msg.finish_reason or None, is_first, logprobs)
                yield sse(chunk(request_id, model, chat, [body]))
                item = await anext(stream, None)
        except RouteError as err:
            yield sse(api.error(err.code, err.details)[1])
        else:
            if include_usage and choices.usages:
                yield sse(chunk(request_id, model, chat, [], usage=choices.usage()))
    yield "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
