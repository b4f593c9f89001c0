"""Structured outputs (``engine.structured_output``) on the bundled model: sampled output valid against JSON
schemas, regexes, choices and grammars, every time; ending with "stop"; bad specs refused; the rows beside a
constrained one untouched; one compilation per distinct grammar; the same tokens with speculative decoding, a
continuation, preemption, and while a grammar compiles."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from engine import LLM, Continuation, SamplingParams
from engine.structured_output import StructuredOutput

SCHEMAS = {
    "nested": {"type": "object", "properties": {"user": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                         "active": {"type": "boolean"}},
        "required": ["id", "active"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"type": "string", "enum": ["S", "M", "L"]}},
             "required": ["color", "size"], "additionalProperties": False},
    "array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1,
              "maxItems": 4},
    "bounds": {"type": "object", "properties": {"n": {"type": "integer", "exclusiveMinimum": 0, "maximum": 100},
                                                "x": {"type": "number", "minimum": -1.5, "maximum": 2.5}},
               "required": ["n", "x"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                "required": ["code"], "additionalProperties": False},
}  # fmt: skip
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
NUM_PER_SCHEMA = 200
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def big_llm():
    return LLM("default", num_blocks=1024, max_num_seqs=200)


def constrained(spec: StructuredOutput, temperature: float = 0.0, **kw) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS, structured_output=spec, **kw)


def _check_sampled_outputs(llm, names: list[str], per_schema: int) -> None:
    """``per_schema`` generations at temperature 1 for each schema, all in one batch: every one ends "stop" and
    validates against its schema (``jsonschema``), and they differ (sampled, not one answer repeated)."""
    prompts = [f"Reply with JSON ({name}, example {i}):" for name in names for i in range(per_schema)]
    params = [constrained(StructuredOutput.json(SCHEMAS[name]), temperature=1.0, seed=i)
              for name in names for i in range(per_schema)]  # fmt: skip
    outs = llm.generate(prompts, params)
    for k, name in enumerate(names):
        mine = outs[k * per_schema : (k + 1) * per_schema]
        for out in mine:
            assert out.finish_reason == "stop", out.text
            jsonschema.validate(json.loads(out.text), SCHEMAS[name])
        assert len({out.text for out in mine}) > 1 or per_schema == 1


def test_sampled_outputs_are_valid_against_five_schemas(llm):
    _check_sampled_outputs(llm, list(SCHEMAS), 6)


# on demand: pytest -m soak tests/engine/test_structured_output.py (1.5 to 3.5 minutes a schema on a 2-core CPU)
@pytest.mark.soak
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_one_of_200_sampled_outputs_is_valid_against_its_schema(big_llm, name):
    _check_sampled_outputs(big_llm, [name], NUM_PER_SCHEMA)


def test_regex_choice_grammar_and_json_object(llm):
    regex = StructuredOutput("regex", r"[A-Z][a-z]{2,6} (is|was) [0-9]{1,3}")
    colors = ["red", "green", "light blue"]
    grammar = StructuredOutput("grammar", 'root ::= "(" num " " op " " num ")"\nnum ::= [1-9] [0-9]?\nop ::= "+" | "*"')
    prompts = [f"Answer {i}:" for i in range(12)]
    for spec, check in [(regex, lambda t: re.fullmatch(regex.text, t)),
                        (StructuredOutput.choice(colors), colors.__contains__),
                        (grammar, lambda t: re.fullmatch(r"\([1-9][0-9]? [+*] [1-9][0-9]?\)", t))]:  # fmt: skip
        outs = llm.generate(prompts, [constrained(spec, temperature=1.0, seed=i) for i in range(len(prompts))])
        for out in outs:
            assert out.finish_reason == "stop" and check(out.text), (spec.kind, out.text)
    # any object: at temperature 1 the model may write a value that runs past max_tokens, so greedy here
    objects = ['{"name": "Ada", "age": 36}', '{"ok": true}', '{"city": "Oslo", "tags": ["cold", "north"]}']
    outs = llm.generate([f"Copy this JSON object exactly: {o}\n" for o in objects],
                        SamplingParams(temperature=0, max_tokens=48, structured_output=StructuredOutput("json_object")))
    for out in outs:
        assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict), out.text


@pytest.mark.parametrize("spec, message", [
    (StructuredOutput("json", '{"type": "objekt"}'), "invalid JSON schema: .*objekt"),
    (StructuredOutput("json", "{not json"), "invalid JSON schema: it is not JSON"),
    (StructuredOutput("json", json.dumps({"type": "string", "pattern": "[a-"})), "invalid JSON schema: .*Unclosed"),
    (StructuredOutput("regex", "(ab"), "invalid regex"),
    (StructuredOutput("grammar", 'root ::= "a" | b'), "invalid EBNF grammar: .*b"),
    (StructuredOutput("choice", "[]"), "invalid choice list"),
    (StructuredOutput("xml", "<a/>"), "structured output kind must be one of"),
])  # fmt: skip
def test_a_bad_spec_is_refused_naming_it(llm, spec, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(structured_output=spec)
    params = SamplingParams()
    params.structured_output = spec
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request("Hi", params)
    assert not llm.engine.has_unfinished_requests()


def test_unconstrained_rows_beside_constrained_ones_get_the_same_tokens(llm):
    prompts = [f"Tell me about the number {i}." for i in range(6)]
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = llm.generate(prompts, free)
    mixed = llm.generate(prompts * 2, [free] * 6 + [constrained(StructuredOutput.json(PERSON))] * 6)
    assert [o.token_ids for o in mixed[:6]] == [o.token_ids for o in alone]
    for out in mixed[6:]:
        jsonschema.validate(json.loads(out.text), PERSON)


def test_a_grammar_compiles_once_for_every_request_that_asks_for_it(llm):
    grammars = llm.engine.grammars
    schema = {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}
    before = grammars.num_compiled
    llm.generate(["A:", "B:"], constrained(StructuredOutput.json(schema)))
    assert grammars.num_compiled == before + 1
    llm.generate(["C:"], constrained(StructuredOutput.json(json.dumps(schema))))  # the same text: cached
    assert grammars.num_compiled == before + 1
    llm.generate(["D:"], constrained(StructuredOutput("regex", "[0-9]+")))
    assert grammars.num_compiled == before + 2


def test_speculative_decoding_gives_the_same_constrained_tokens():
    prompts = [f"Describe person {i} as JSON:" for i in range(4)]
    params = constrained(StructuredOutput.json(PERSON))
    plain = LLM("default", num_blocks=256).generate(prompts, params)
    spec = LLM("default", num_blocks=256, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert spec.engine.speculator.stats.num_proposed > 0


def test_a_continuation_replays_its_output_into_the_grammar(llm):
    params = constrained(StructuredOutput.json(PERSON), temperature=0.8, seed=5)
    [whole] = llm.generate(["Describe a person as JSON:"], params)
    tokens = whole.token_ids
    for k in (1, len(tokens) // 2):
        engine = llm.engine
        rid = engine.add_request("Describe a person as JSON:", params, continuation=Continuation(tuple(tokens[:k]), 0))
        rest = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.request_id == rid
                rest += out.new_token_ids
                reason = out.finish_reason
        assert tokens[:k] + rest == tokens and reason == "stop"


def test_preempted_requests_keep_their_matcher():
    small = LLM("default", block_size=16, num_blocks=10, max_num_seqs=8)  # too few blocks for 8 at once
    prompts = [f"Describe person number {i} in one JSON object, please:" for i in range(8)]
    outs = small.generate(prompts, [constrained(StructuredOutput.json(PERSON), temperature=1.0, seed=i)
                                    for i in range(8)])  # fmt: skip
    assert small.engine.scheduler.num_preemptions > 0
    for out in outs:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), PERSON)


def test_a_request_waits_for_its_grammar_while_the_batch_runs(llm, monkeypatch):
    engine, gate = llm.engine, threading.Event()
    compile_now = engine.grammars._compile
    monkeypatch.setattr(engine.grammars, "_compile", lambda spec: gate.wait(60) and compile_now(spec))
    waiting = engine.add_request("A:", constrained(StructuredOutput("regex", "(yes|no)!")))
    running = engine.add_request("B:", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    finished = {}
    for _ in range(4):
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert running in finished and waiting not in finished
    gate.set()
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished[waiting].text in ("yes!", "no!") and finished[waiting].finish_reason == "stop"


def test_a_grammar_that_fails_to_compile_aborts_its_request(llm, monkeypatch):
    def fail(spec):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(llm.engine.grammars, "_compile", fail)
    [out] = llm.generate(["A:"], constrained(StructuredOutput("regex", "fails[0-9]")))
    assert out.finish_reason == "abort" and out.token_ids == []
