"""``engine.outputs``: a step's ``RequestOutput`` is built lazily from the sequence, yet stays as it was at its
step, and the text deltas add up to the whole text."""

from __future__ import annotations

from engine_testing import greedy


def test_outputs_are_built_lazily_and_stay_as_of_their_step(llm, engine_prompts):
    engine = llm.engine
    rid = engine.add_request(engine_prompts[0], greedy(max_tokens=6))
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    assert [len(o.token_ids) for o in outputs] == [1, 2, 3, 4, 5, 6]
    assert outputs[2].token_ids == outputs[-1].token_ids[:3]
    assert "".join(o.new_text for o in outputs) == outputs[-1].text
    assert outputs[-1].request_id == rid and outputs[-1].finished
