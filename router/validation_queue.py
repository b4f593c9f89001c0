"""The router's validation thread: every public request is checked and tokenized there (``rpc.validation``),
never on the event loop that relays every stream.

A request's way through it:

1. On the event loop, without tokenizing: its size, the characters of its text (or of its chat messages'
   contents; token ids count one each). A prompt longer than ``max_prompt_chars`` is refused at once
   with ``ValueError`` (INVALID_ARGUMENT, HTTP 400), untokenized: no token is longer than the vocabulary's
   longest, so no longer text fits the model's context (``prompt_chars_limit``).
2. Still on the loop: when the backlog (the sizes of the requests waiting or being validated) is not empty and
   this request would take it past ``max_backlog``, it is refused with ``ValidationBusy`` (RESOURCE_EXHAUSTED,
   HTTP 429). The backlog is a measure of work: tokenizing takes about a second per million characters on
   one laptop core, so the default of 4 Mi characters bounds the queue to a few seconds.
3. It waits for the one validation thread, which takes the smallest waiting request first: a short request
   waits for the one long prompt being tokenized at most, never for a queue of them. (A long prompt waits
   while shorter ones keep coming; they take milliseconds each, so only an overloaded router delays it
   much.) A request whose client left while it waited is dropped unvalidated.

One thread, because Hugging Face tokenizers are not safe to share between threads and it bounds validation's
CPU share; tokenizing releases the GIL, so the event loop goes on serving meanwhile. The HTTP API's
``/tokenize`` and ``/detokenize`` use the tokenizer on the same thread, through the same queue (``run``).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from protos.kvserve.v1 import kvserve_pb2 as pb
from rpc.chat import chat_texts
from rpc.validation import MAX_PROMPT_BYTES, validate_generate

DEFAULT_MAX_BACKLOG = 4 << 20  # prompt characters
_T = TypeVar("_T")


class ValidationBusy(Exception):
    """The validation backlog is full: the client should retry shortly (RESOURCE_EXHAUSTED, HTTP 429)."""


def prompt_chars_limit(tokenizer: Tokenizer | None, max_context: int) -> int:
    """Characters past which no prompt fits ``max_context`` tokens: the context times the longest token's
    characters (a vocabulary entry's length is at least its text's: byte-level BPE spells each byte as one
    character, SentencePiece a space as one); never more than ``rpc.validation.MAX_PROMPT_BYTES``."""
    if tokenizer is None:
        return MAX_PROMPT_BYTES
    longest = max(map(len, tokenizer.hf.get_vocab()))
    return min(max_context * longest, MAX_PROMPT_BYTES)


class ValidationQueue:
    """``validate_generate`` on one thread of its own, smallest request first, with a bounded backlog (see the
    module docstring). ``backlog`` counts what was admitted and has not finished or been dropped."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, max_context: int,
                 max_backlog: int = DEFAULT_MAX_BACKLOG, max_prompt_chars: int | None = None) -> None:  # fmt: skip
        if max_backlog < 1:
            raise ValueError(f"--max-validation-backlog must be at least 1, got {max_backlog}")
        self.tokenizer, self.vocab_size, self.max_context = tokenizer, vocab_size, max_context
        self.max_backlog = max_backlog
        self.max_prompt_chars = max_prompt_chars or prompt_chars_limit(tokenizer, max_context)
        self.backlog = 0
        self._lock = threading.Lock()  # the backlog shrinks on the validation thread
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()  # first come first served among equal sizes
        self._thread = threading.Thread(target=self._work, name="router-validate", daemon=True)
        self._thread.start()

    async def validate(self, request: pb.GenerateRequest) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids and sampling parameters (``rpc.validation.validate_generate``); ``ValueError``
        for a bad request, ``ValidationBusy`` when the backlog is full. Cancelling the caller drops a request that
        still waits."""
        size = self._admit(request)
        return await self._submit(size, lambda: validate_generate(request, self.tokenizer, self.vocab_size,
                                                                  self.max_context))  # fmt: skip

    async def run(self, num_chars: int, work: Callable[[], _T], what: str = "the text is") -> _T:
        """``work()`` (which uses the tokenizer) on the validation thread, queued as a prompt of ``num_chars``
        characters: refused the same way past ``max_prompt_chars`` (``ValueError``) or a full backlog."""
        self._check_chars(num_chars, what)
        return await self._submit(self._reserve(max(num_chars, 1)), work)

    async def _submit(self, size: int, work: Callable[[], _T]) -> _T:
        job: Future = Future()
        job.add_done_callback(lambda _: self._release(size))  # done, failed or dropped: once
        self._jobs.put((size, next(self._order), job, work))
        return await asyncio.wrap_future(job)  # a cancelled wrapper cancels the job if it has not started

    def close(self) -> None:
        """Drop what waits and end the thread (after the request it is validating, if any)."""
        while True:
            try:
                _, _, job, _ = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
        self._jobs.put((-1, -1, None, None))

    def _admit(self, request: pb.GenerateRequest) -> int:
        kind = request.WhichOneof("prompt")
        if kind == "token_ids":
            size = len(request.token_ids.ids)
        else:
            size = len(request.text) if kind == "text" else sum(map(len, chat_texts(request.chat)))
            self._check_chars(size, "prompt text is" if kind == "text" else "chat messages' contents are")
        return self._reserve(max(size, 1))

    def _check_chars(self, num_chars: int, what_is: str) -> None:
        if num_chars > self.max_prompt_chars:
            raise ValueError(f"{what_is} {num_chars} characters long; no text longer than {self.max_prompt_chars} "
                             f"characters fits the model's context of {self.max_context} tokens")  # fmt: skip

    def _reserve(self, size: int) -> int:
        with self._lock:
            if self.backlog and self.backlog + size > self.max_backlog:
                raise ValidationBusy(
                    f"the router's validation queue is full ({self.backlog} prompt characters wait to be "
                    f"tokenized; limit {self.max_backlog}, --max-validation-backlog): retry in a moment"
                )
            self.backlog += size
        return size

    def _release(self, size: int) -> None:
        with self._lock:
            self.backlog -= size

    def _work(self) -> None:
        while True:
            _, _, job, work = self._jobs.get()
            if job is None:
                return
            if not job.set_running_or_notify_cancel():
                continue  # its client left while it waited
            try:
                job.set_result(work())
            except BaseException as err:  # the caller gets every failure
                job.set_exception(err)
