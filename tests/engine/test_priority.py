"""Request priorities in the engine (``engine.scheduler``'s docstring): under ``scheduling_policy="priority"`` a
request of a higher priority (lower number) preempts a running one of a lower priority when it finds no room,
and both still give the tokens of an engine without preemption; under FCFS it waits its turn; a priority
outside the int32 range is refused naming it."""

from __future__ import annotations

import pytest

from engine import LLMEngine, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _finish_order(engine: LLMEngine, prompts: list[list[int]]) -> tuple[list[str], dict[str, list[int]]]:
    """``prompts[0]`` at priority 5 first; after three steps ``prompts[1]`` at priority -1. The request ids in
    the order they finished, and their tokens."""
    engine.add_request(prompts[0], GREEDY, "low", priority=5)
    for _ in range(3):
        engine.step()
    engine.add_request(prompts[1], GREEDY, "high", priority=-1)
    order, tokens = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
                tokens[out.request_id] = out.token_ids
    return order, tokens


def test_a_higher_priority_request_preempts_a_running_one_under_the_priority_policy(llm, engine_prompts):
    prompts = [engine_prompts[5][:40], engine_prompts[6][:30]]
    want = {rid: o.token_ids for rid, o in zip(("low", "high"), llm.generate(prompts, GREEDY), strict=True)}
    one_slot = {"model": "default", "max_num_seqs": 1, "num_blocks": 64, "skip_tokenizer_init": True}
    urgent = LLMEngine(scheduling_policy="priority", **one_slot)
    order, tokens = _finish_order(urgent, prompts)
    assert order == ["high", "low"] and urgent.scheduler.num_preemptions == 1
    assert tokens == want  # the preempted request is recomputed from its prompt and the output it had
    order, tokens = _finish_order(LLMEngine(**one_slot), prompts)  # fcfs: it waits for the slot
    assert order == ["low", "high"] and tokens == want


def test_priorities_outside_the_int32_range_are_refused_naming_them(llm, engine_prompts):
    for bad in (2**31, -(2**31) - 1, 1.5, True):
        with pytest.raises(ValueError, match="priority must be an integer in"):
            llm.engine.add_request(engine_prompts[0], GREEDY, priority=bad)
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        llm.generate(engine_prompts[:2], GREEDY, priority=[0])
    out = llm.generate(engine_prompts[:2], GREEDY, priority=[2**31 - 1, -(2**31)])
    assert len(out) == 2 and not llm.engine.has_unfinished_requests()


def test_llm_generate_gives_each_prompt_its_priority(llm, engine_prompts, monkeypatch):
    queued = []
    add = llm.engine.add_request
    monkeypatch.setattr(llm.engine, "add_request", lambda *a, **k: queued.append(k["priority"]) or add(*a, **k))
    outs = llm.generate(engine_prompts[:3], GREEDY, priority=[3, 1, 2])
    assert queued == [3, 1, 2] and len(outs) == 3
