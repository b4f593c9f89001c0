"""Log-probabilities in OpenAI's two response shapes, from the wire's ``pb.TokenLogprob`` entries.

* completions (``logprobs=k``, and with ``echo`` the prompt's first): ``{"tokens", "token_logprobs",
  "top_logprobs", "text_offset"}``, one list entry per token; the prompt's first token has no log-probability
  (``None`` in both lists), as in OpenAI's and vLLM's answers;
* chat (``logprobs: true``, ``top_logprobs=k``): ``{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}]}]}``.

A token's string is its own decoding (``Tokenizer.decode([id])``, special tokens kept), so a character that
spans several tokens shows as replacement characters in each, as in vLLM; ``bytes`` are that string's UTF-8.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from protos.kvserve.v1 import kvserve_pb2 as pb


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


class TokenText:
    """Token id -> its string, memoized (a stream asks for the same alternatives again and again); without a
    tokenizer (``--skip-tokenizer-init``), ``"token_id:<id>"``, as vLLM spells a token it cannot show."""

    def __init__(self, tokenizer: Decoder | None) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = (f"token_id:{token_id}" if self._tokenizer is None
                    else self._tokenizer.decode([token_id], skip_special_tokens=False))  # fmt: skip
            self._cache[token_id] = text
        return text


class CompletionLogprobs:
    """Builds the completions shape for one choice, chunk after chunk: ``text_offset`` counts on from
    ``start`` (the characters before this choice's first token: 0, or after an echoed prompt its length)."""

    def __init__(self, text_of: TokenText, start: int = 0) -> None:
        self._text_of = text_of
        self._offset = start

    def add(self, token_ids: Sequence[int], entries: Iterable[pb.TokenLogprob | None]) -> dict[str, list[Any]]:
        """The shape for ``token_ids`` (``entries``: theirs; None for a token without one)."""
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, entry in zip(token_ids, entries, strict=True):
            text = self._text_of(token_id)
            out["tokens"].append(text)
            out["text_offset"].append(self._offset)
            self._offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                out["token_logprobs"].append(entry.logprob)
                out["top_logprobs"].append({self._text_of(t.token_id): t.logprob for t in entry.top})
        return out


def prompt_entries(msg: pb.GenerateResponse) -> tuple[list[int], list[pb.TokenLogprob | None]]:
    """(the prompt's token ids, their entries: None for the first) from a first message that has them."""
    return list(msg.prompt_token_ids), [None, *msg.prompt_logprobs]


def merge(parts: Iterable[dict[str, list[Any]]]) -> dict[str, list[Any]]:
    """One completions shape of several, in order."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key, values in part.items():
            out[key].extend(values)
    return out


def chat_content(text_of: TokenText, entries: Iterable[pb.TokenLogprob]) -> list[dict[str, Any]]:
    """The chat shape's ``content`` list for ``entries``."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text = text_of(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return [one(e.token_id, e.logprob) | {"top_logprobs": [one(t.token_id, t.logprob) for t in e.top]}
            for e in entries]  # fmt: skip


class Choice:
    """One choice's pieces, message after message: its text (after the echoed prompt, for completions with
    ``echo``) and its log-probabilities in the endpoint's shape (None when the request asked for none)."""

    def __init__(self, chat: bool, text_of: TokenText, logprobs: bool, echo: str | None = None) -> None:
        self.chat, self.logprobs, self.echo = chat, logprobs, echo
        self._text_of = text_of
        self._completion = CompletionLogprobs(text_of)
        self._first = True

    def piece(self, msg: pb.GenerateResponse) -> tuple[str, dict[str, Any] | None]:
        """(text, log-probabilities) of ``msg``."""
        text, first = msg.text, self._first
        self._first = False
        if first and self.echo is not None:
            text = self.echo + text
        if not self.logprobs:
            return text, None
        if self.chat:
            return text, {"content": chat_content(self._text_of, msg.logprobs)}
        parts = [self._completion.add(*prompt_entries(msg))] if first and msg.prompt_token_ids else []
        parts.append(self._completion.add(msg.token_ids, msg.logprobs))
        return text, merge(parts)

    def join(self, pieces: list[dict[str, Any] | None]) -> dict[str, Any] | None:
        """The log-probabilities of a whole answer from its pieces'."""
        if not self.logprobs:
            return None
        if self.chat:
            return {"content": [entry for piece in pieces for entry in piece["content"]]}
        return merge(pieces)
