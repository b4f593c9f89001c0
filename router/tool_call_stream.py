"""One choice's answer streamed as OpenAI's tool-call deltas (``router.openai_tools`` says what each
``tool_choice`` streams): content until a call may begin, then each call's name and its arguments piece by
piece, adding up to what ``router.openai_tools.parse`` makes of the whole answer."""

from __future__ import annotations

from typing import Any

from router.openai_tools import (
    HERMES_CLOSE,
    HERMES_HEAD,
    HERMES_OPEN,
    PYTHON_TAG,
    Call,
    hermes_call,
    hermes_calls,
    parse,
)

_HELD_TAIL = "} \t\r\n"  # a streamed call's arguments keep these back: they may close the call, not them


class ToolCallStream:
    """One choice's answer, streamed as OpenAI's deltas: ``feed`` each text piece, then ``finish``; each
    returns (content, tool-call deltas). The content sent and the calls add up to what ``parse`` makes of the
    whole text (only the calls' ids differ)."""

    def __init__(self, mode: str, fmt: str, name: str = "", parallel: bool = True) -> None:
        self.mode: str | None = mode
        self.fmt, self.name, self.parallel = fmt, name, parallel
        self.text = ""
        self.calls: list[Call] = []
        self._sent = 0  # characters of text accounted for: sent as content, or inside a call already sent
        self._content_started = False  # blank content before a call is not content: held until text shows
        self._held = False  # the rest waits for the answer's end (Llama 3, required, or a call that failed)
        self._open: tuple[int, int, int] | None = None  # a Hermes call whose arguments stream: (index, start, sent)

    @property
    def made_calls(self) -> bool:
        """Whether the answer's finish_reason is "tool_calls"."""
        return self.mode in ("auto", "required") and bool(self.calls)

    def feed(self, piece: str) -> tuple[str, list[dict[str, Any]]]:
        self.text += piece
        if self.mode == "named":
            return "", self._named(piece)
        if self.mode == "required" or self._held:
            return "", []
        if self.mode == "auto" and self.fmt == "llama3_json":
            head = self.text.lstrip()
            if head.startswith(("{", PYTHON_TAG)):
                self._held = True
            if self._held or not head or PYTHON_TAG.startswith(head):
                return "", []
            self.mode = None  # not a call: plain text, sent as it comes
        return self._hermes() if self.mode == "auto" else (self._content(len(self.text)), [])

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The rest, once the answer has ended."""
        if self.mode == "named":
            return "", [] if self.calls else self._named("")
        if self.mode is None:
            return self._content(len(self.text), force=True), []
        if self._open is not None:  # Hermes: the streaming call never closed
            return "", self._close(hermes_call(self.text[self._body_start():]), len(self.text))
        if self.calls:  # Hermes: a last call that never closed
            start = self.text.find(HERMES_OPEN, self._sent)
            more = [] if self._held or start < 0 else hermes_calls(self.text[start:])
            return "", self._add(more)
        _, calls = parse(self.mode, self.fmt, self.text)
        if not calls:
            return self._content(len(self.text), force=True), []
        self._sent = len(self.text)
        return "", self._add(calls)

    def _named(self, piece: str) -> list[dict[str, Any]]:
        if self.calls:
            return [{"index": 0, "function": {"arguments": piece}}] if piece else []
        self.calls.append(Call(self.name, ""))
        call = self.calls[0].body()
        call["function"]["arguments"] = piece
        return [{"index": 0} | call]

    def _hermes(self) -> tuple[str, list[dict[str, Any]]]:
        """Content up to a possible ``<tool_call>``; each call's name once it shows, then its arguments as they
        come (a call whose name does not come first: whole, once it closes)."""
        deltas: list[dict[str, Any]] = []
        content = ""
        while not self._held:
            start = self.text.find(HERMES_OPEN, self._sent)
            if start < 0:
                if not self.calls:  # text after the calls is not content (as parse has it)
                    content += self._content(len(self.text) - _partial_tag(self.text, HERMES_OPEN))
                break
            if not self.calls:
                content += self._content(start)
            body = start + len(HERMES_OPEN)
            end = self.text.find(HERMES_CLOSE, body)
            if end < 0:
                deltas += self._stream_arguments(body)
                break
            call = hermes_call(self.text[body:end])
            if call is None and self._open is None:  # the rest waits for finish (no call yet: all content)
                self._held = True
                break
            self._sent = end + len(HERMES_CLOSE)
            deltas += self._close(call, end) if self._open is not None else self._add([call])
        return content, deltas

    def _stream_arguments(self, body: int) -> list[dict[str, Any]]:
        """The open call's name (once), then what of its arguments cannot still turn out to close it."""
        deltas = []
        if self._open is None:
            head = HERMES_HEAD.match(self.text, body)
            if head is None or not (self.parallel or not self.calls):
                return []
            deltas = self._add([Call(head.group(1), "")])
            self._open = (len(self.calls) - 1, head.end(), 0)
        _, start, sent = self._open
        safe = len(self.text) - _partial_tag(self.text, HERMES_CLOSE)
        safe = max(len(self.text[:safe].rstrip(_HELD_TAIL)), start + sent)
        return deltas + self._arguments(self.text[start + sent: safe])

    def _close(self, call: Call | None, end: int) -> list[dict[str, Any]]:
        """The rest of the streaming call's arguments, its body ending at ``end``: as parsed, or, where the
        body turned out malformed, as written up to the call's closing brace."""
        index, start, sent = self._open
        written = self.text[start:end].rstrip()
        arguments = call.arguments if call is not None else written.removesuffix("}").rstrip()
        if not arguments.startswith(self.text[start: start + sent]):
            arguments = written  # (a call that parsed whole but not as streamed: what was written stands)
        return self._arguments(arguments[sent:], final=arguments)

    def _arguments(self, piece: str, final: str | None = None) -> list[dict[str, Any]]:
        index, start, sent = self._open
        self.calls[index].arguments += piece
        self._open = None if final is not None else (index, start, sent + len(piece))
        return [{"index": index, "function": {"arguments": piece}}] if piece else []

    def _body_start(self) -> int:
        return self.text.find(HERMES_OPEN, self._sent) + len(HERMES_OPEN)

    def _content(self, upto: int, force: bool = False) -> str:
        piece = self.text[self._sent: upto]
        if not (force or self._content_started or piece.strip()):
            return ""
        self._content_started = self._content_started or bool(piece)
        self._sent = max(self._sent, upto)
        return piece

    def _add(self, calls: list[Call]) -> list[dict[str, Any]]:
        if not self.parallel:
            calls = calls[: max(0, 1 - len(self.calls))]
        first = len(self.calls)
        self.calls += calls
        return [{"index": first + i} | call.body() for i, call in enumerate(calls)]


def _partial_tag(text: str, tag: str) -> int:
    """How many of ``text``'s last characters could begin ``tag``: held back until the next piece says."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
