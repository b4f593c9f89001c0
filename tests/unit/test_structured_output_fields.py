"""Structured outputs as the doors take them: OpenAI's ``response_format`` and vLLM's ``structured_outputs``
(HTTP bodies, ``build_request``), the wire's ``StructuredOutput`` both ways, and the router's checks
(``rpc.validation``): a bad shape or a bad schema, regex or grammar is refused naming it."""

from __future__ import annotations

import json

import pytest

from engine import SamplingParams
from engine.structured_output import StructuredOutput
from protos.kvserve.v1 import kvserve_pb2 as pb
from router.openai_fields import FieldError
from router.openai_protocol import ChatCompletionRequest, CompletionRequest
from rpc.convert import sampling_from_proto, sampling_to_proto
from rpc.requests import build_request
from rpc.validation import MAX_STRUCTURED_BYTES, validate_sampling

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
VOCAB = 49152


def _spec(**options) -> StructuredOutput | None:
    return sampling_from_proto(build_request("hi", **options).sampling).structured_output


@pytest.mark.parametrize("options, expected", [
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     StructuredOutput.json(SCHEMA)),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput.json(SCHEMA)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredOutput.json(SCHEMA)),
    ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutput("regex", "[0-9]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutput.choice(["yes", "no"])),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredOutput("grammar", 'root ::= "a"')),
    ({"structured_outputs": {"json_object": True, "regex": None}}, StructuredOutput("json_object")),
    ({}, None),
])  # fmt: skip
def test_both_shapes_reach_the_engine_as_one_structured_output(options, expected):
    assert _spec(**options) == expected


@pytest.mark.parametrize("spec", [StructuredOutput.json(SCHEMA), StructuredOutput("json_object"),
                                  StructuredOutput("regex", "a+"), StructuredOutput.choice(["x", 'y "z"']),
                                  StructuredOutput("grammar", 'root ::= "a"')])  # fmt: skip
def test_the_wire_carries_a_structured_output_both_ways(spec):
    params = SamplingParams(max_tokens=5, structured_output=spec)
    assert sampling_from_proto(sampling_to_proto(params)) == params


@pytest.mark.parametrize("options, message", [
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
    ({"structured_outputs": {}}, "exactly one of"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag is not served"),
    ({"structured_outputs": {"choice": "a"}}, "structured_outputs.choice must be a list of strings"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex must be a string"),
    ({"response_format": {"type": "yaml"}}, "response_format.type must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "both constrain"),
])  # fmt: skip
def test_a_shape_that_says_no_one_thing_is_refused(options, message):
    with pytest.raises(ValueError, match=message):
        build_request("hi", **options)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "grammar": "b"}}, "structured_outputs"),
])  # fmt: skip
def test_the_http_bodies_name_the_field_at_fault(body, param):
    for request in (CompletionRequest(prompt="hi", **body),
                    ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **body)):  # fmt: skip
        with pytest.raises(FieldError) as err:
            request.to_protos("r") if isinstance(request, CompletionRequest) else request.to_proto("r")
        assert err.value.param == param


def test_the_http_bodies_carry_them():
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})  # fmt: skip
    assert sampling_from_proto(chat.to_proto("r").sampling).structured_output == StructuredOutput.json(SCHEMA)
    completion = CompletionRequest(prompt="hi", structured_outputs={"choice": ["a", "b"]})
    [proto] = completion.to_protos("r")
    assert sampling_from_proto(proto.sampling).structured_output.kind == "choice"


@pytest.mark.parametrize("structured, message", [
    (pb.StructuredOutput(json_schema='{"type": "objekt"}'), "invalid JSON schema: .*objekt"),
    (pb.StructuredOutput(json_schema="{"), "invalid JSON schema: it is not JSON"),
    (pb.StructuredOutput(regex="(a"), "invalid regex"),
    (pb.StructuredOutput(grammar="root ::= missing"), "invalid EBNF grammar"),
    (pb.StructuredOutput(choice=pb.ChoiceList()), "invalid choice list"),
    (pb.StructuredOutput(json_object=False), "json_object must be true"),
    (pb.StructuredOutput(), "names no kind"),
    (pb.StructuredOutput(regex="a" * MAX_STRUCTURED_BYTES), "structured_output is .* bytes"),
])  # fmt: skip
def test_the_router_refuses_what_does_not_parse_naming_it(structured, message):
    opts = pb.SamplingOptions(structured_output=structured)
    with pytest.raises(ValueError, match=message):
        validate_sampling(opts, VOCAB)
