"""A continuation (``engine.Continuation``) goes on from output another worker streamed exactly as the
uninterrupted request would have: the same tokens (greedy and seeded), the same text, and stop strings and
``max_tokens`` counted across the hand-over."""

from __future__ import annotations

import pytest

from engine import Continuation, SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _run(engine, prompt, params, continuation=None) -> list[tuple[int, str, str | None]]:
    """(token, text delta, finish reason) per token, in order."""
    rid = engine.add_request(prompt, params, continuation=continuation)
    steps = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid
            steps.append((out.new_token_ids[0], out.new_text, out.finish_reason))
    return steps


def _resumed_at(steps, k: int) -> Continuation:
    """What a router holds after relaying the first ``k`` messages of ``steps``."""
    return Continuation(tuple(t for t, _, _ in steps[:k]), sum(len(text) for _, text, _ in steps[:k]))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=99, repetition_penalty=1.3, max_tokens=24, ignore_eos=True),
], ids=["greedy", "seeded", "seeded-repetition-penalty"])  # fmt: skip
def test_continuation_yields_the_rest_of_the_uninterrupted_stream(llm, params):
    whole = _run(llm.engine, PROMPT, params)
    assert len(whole) == 24
    for k in (1, 9, 23):
        rest = _run(llm.engine, PROMPT, params, _resumed_at(whole, k))
        assert [t for t, _, _ in rest] == [t for t, _, _ in whole[k:]], f"resumed after {k} tokens"
        assert "".join(text for _, text, _ in rest) == "".join(text for _, text, _ in whole[k:])
        assert rest[-1][2] == "length"


def test_stop_string_across_the_hand_over_is_found_and_held_back_text_is_sent(llm):
    plain = _run(llm.engine, PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    text = "".join(d for _, d, _ in plain)
    k = 8
    boundary = len("".join(d for _, d, _ in plain[:k]))
    stop = text[boundary - 3 : boundary + 4]  # spans the text of tokens before and after the hand-over
    assert len(stop) == 7 and text.find(stop) == boundary - 3, "pick a stop string that occurs only there"
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    whole = _run(llm.engine, PROMPT, params)
    assert whole[-1][2] == "stop"
    # the stream held back text that might start the stop string: the continuation must send exactly that
    emitted = sum(len(d) for _, d, _ in whole[:k])
    assert emitted < boundary
    rest = _run(llm.engine, PROMPT, params, _resumed_at(whole, k))
    assert [t for t, _, _ in rest] == [t for t, _, _ in whole[k:]]
    assert "".join(d for _, d, _ in whole[:k] + rest) == text[: boundary - 3]
    assert rest[-1][2] == "stop"


def test_continuation_is_validated(llm):
    params = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match="1 to max_tokens - 1"):
        llm.engine.add_request(PROMPT, params, continuation=Continuation((1, 2, 3, 4), 0))
    with pytest.raises(ValueError, match="resumed output token"):
        llm.engine.add_request(PROMPT, params, continuation=Continuation((10**9,), 0))
    with pytest.raises(ValueError, match="num_resumed_chars"):
        llm.engine.add_request(PROMPT, params, continuation=Continuation((5,), -1))
    assert not llm.engine.has_unfinished_requests()
