"""The router's validation thread (``router.validation_queue``) as clients meet it over real gRPC: long prompts
queued ahead do not stall a short one, the backlog is bounded (RESOURCE_EXHAUSTED), a prompt too long for any
context is refused untokenized, and a request whose client left while it waited is never tokenized.

The tokenizer is the real one behind a gate the test opens, so what waits where is certain, not timed. No
decode worker is up: a request that passed validation ends with UNAVAILABLE, one refused by it earlier."""

from __future__ import annotations

import threading

import grpc
import pytest
from service_utils import TEST_SECURITY, InProcessServer
from waiting import wait_until

from engine.model_config import ModelConfig
from engine.tokenizer import Tokenizer
from kvserve.client import Client
from router.server import Router

BACKLOG = 10_000  # prompt characters


class GatedTokenizer:
    """The real tokenizer, but ``encode`` waits for ``gate`` and records the length of each text it got."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner, self.hf = inner, inner.hf
        self.gate, self.entered = threading.Event(), threading.Event()
        self.encoded: list[int] = []

    def encode(self, text: str) -> list[int]:
        self.entered.set()
        assert self.gate.wait(60)
        self.encoded.append(len(text))
        return self.inner.encode(text)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        return self.inner.apply_chat_template(messages, add_generation_prompt)


@pytest.fixture()
def door(model_dir):
    """(router's address, gated tokenizer, router); the gate is open again at the end."""
    tokenizer = GatedTokenizer(Tokenizer(model_dir))
    config = ModelConfig.from_dir(model_dir)
    router = Router(tokenizer, config.vocab_size, config.max_context, TEST_SECURITY, decode_addresses=[],
                    max_validation_backlog=BACKLOG)  # fmt: skip
    server = InProcessServer({"Inference": router})
    yield server.address, tokenizer, router
    tokenizer.gate.set()
    server.stop()


def _status(address: str, prompt, timeout_s: float = 60) -> grpc.StatusCode:
    with Client(address, timeout_s=timeout_s) as client:
        try:
            client.generate(prompt, max_tokens=1)
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def _in_background(address: str, prompt, results: dict, timeout_s: float = 60) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.__setitem__(len(prompt), _status(address, prompt, timeout_s)))
    thread.start()
    return thread


def test_a_short_prompt_does_not_wait_behind_long_ones(door):
    """The probe 'ten 1 MiB prompts stall everyone': the validation thread takes the shortest waiting prompt
    first, so a short request waits at most for the one long prompt being tokenized."""
    address, tokenizer, router = door
    results: dict[int, grpc.StatusCode] = {}
    threads = [_in_background(address, "x" * 3000, results)]
    wait_until(tokenizer.entered.is_set, 30, "the first long prompt to be tokenized")
    for n in (2000, 2500):
        threads.append(_in_background(address, "y" * n, results))
    threads.append(_in_background(address, "Hi", results))
    wait_until(lambda: router._validator.backlog == 3000 + 2000 + 2500 + 2, 30, "all four to be queued")
    tokenizer.gate.set()
    for t in threads:
        t.join()
    assert tokenizer.encoded == [3000, 2, 2000, 2500]
    assert set(results.values()) == {grpc.StatusCode.UNAVAILABLE}  # all validated; no decode worker is up


def test_a_full_backlog_is_resource_exhausted(door):
    address, tokenizer, router = door
    results: dict[int, grpc.StatusCode] = {}
    threads = [_in_background(address, "x" * 6000, results)]
    wait_until(tokenizer.entered.is_set, 30, "the first prompt to be tokenized")
    threads.append(_in_background(address, "y" * 3000, results))
    wait_until(lambda: router._validator.backlog == 9000, 30, "the second prompt to be queued")
    with Client(address, timeout_s=60) as client, pytest.raises(grpc.RpcError) as err:
        client.generate("z" * 1001, max_tokens=1)  # 9000 + 1001 > 10000
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "validation queue is full" in err.value.details() and "--max-validation-backlog" in err.value.details()
    tokenizer.gate.set()
    for t in threads:
        t.join()
    assert 1001 not in tokenizer.encoded
    assert _status(address, "z" * 1001) == grpc.StatusCode.UNAVAILABLE  # the backlog drained: validated


def test_a_prompt_no_context_can_hold_is_refused_untokenized(door):
    address, tokenizer, router = door
    limit = router._validator.max_prompt_chars
    assert limit == 8192 * max(map(len, tokenizer.hf.get_vocab()))  # the bundled model: 8k context
    tokenizer.gate.set()
    for prompt, what in [("a" * (limit + 1), "prompt text is"),
                         ([{"role": "user", "content": "a" * limit}, {"role": "user", "content": "b"}],
                          "chat messages' contents are")]:  # fmt: skip
        with Client(address, timeout_s=60) as client, pytest.raises(grpc.RpcError) as err:
            client.generate(prompt, max_tokens=1)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"{what} {limit + 1} characters long; no text longer than {limit} characters fits" in (
            err.value.details()
        )
    assert tokenizer.encoded == []


def test_a_request_whose_client_left_while_waiting_is_never_tokenized(door):
    address, tokenizer, router = door
    results: dict[int, grpc.StatusCode] = {}
    first = _in_background(address, "x" * 3000, results)
    wait_until(tokenizer.entered.is_set, 30, "the first prompt to be tokenized")
    assert _status(address, "y" * 500, timeout_s=0.5) == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: router._validator.backlog == 3000, 30, "the dropped request to leave the backlog")
    tokenizer.gate.set()
    first.join()
    assert tokenizer.encoded == [3000]
