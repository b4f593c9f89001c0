"""The mapping between the wire's sampling options and the engine's ``SamplingParams``, and from the engine's
log-probabilities to the wire's."""

from __future__ import annotations

import json
from collections.abc import Iterable

from engine import SamplingParams
from engine.logprobs import TokenLogprob
from engine.structured_output import StructuredOutput
from protos.kvserve.v1 import kvserve_pb2 as pb

# the optional scalar fields of ``pb.SamplingOptions``, named as in ``SamplingParams``
_OPTIONAL = ("temperature", "top_p", "top_k", "seed", "max_tokens", "repetition_penalty", "streaming_window",
             "streaming_sinks", "speculative", "presence_penalty", "frequency_penalty", "min_tokens", "min_p",
             "logprobs", "prompt_logprobs", "n")  # fmt: skip


def sampling_from_proto(opts: pb.SamplingOptions) -> SamplingParams:
    """Unset fields take ``SamplingParams``' defaults; invalid values raise ``ValueError`` with the reason."""
    kwargs = {name: getattr(opts, name) for name in _OPTIONAL if opts.HasField(name)}
    if opts.HasField("structured_output"):
        kwargs["structured_output"] = structured_from_proto(opts.structured_output)
    return SamplingParams(stop=list(opts.stop), stop_token_ids=list(opts.stop_token_ids), ignore_eos=opts.ignore_eos,
                          logit_bias=dict(opts.logit_bias), **kwargs)  # fmt: skip


def sampling_to_proto(params: SamplingParams) -> pb.SamplingOptions:
    """Inverse of ``sampling_from_proto``: every field set, so the receiver sees exactly these settings."""
    opts = pb.SamplingOptions(stop=params.stop, stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos,
                              logit_bias=params.logit_bias)  # fmt: skip
    for name in _OPTIONAL:  # None: unset, so the receiver's default holds
        if getattr(params, name) is not None:
            setattr(opts, name, getattr(params, name))
    if params.structured_output is not None:
        opts.structured_output.CopyFrom(structured_to_proto(params.structured_output))
    return opts


def logprobs_from_proto(entries: Iterable[pb.TokenLogprob]) -> list[TokenLogprob]:
    return [TokenLogprob(e.token_id, e.logprob, [(t.token_id, t.logprob) for t in e.top]) for e in entries]


_KIND_FIELDS = {"json": "json_schema", "regex": "regex", "grammar": "grammar"}  # kinds whose text goes as it is


def structured_from_proto(msg: pb.StructuredOutput) -> StructuredOutput:
    """The engine's ``StructuredOutput`` of the wire's; ``ValueError`` when no kind is set, or json_object false."""
    field = msg.WhichOneof("kind")
    if field is None:
        raise ValueError("structured_output is set but names no kind: set json_schema, json_object, regex, "
                         "choice or grammar")  # fmt: skip
    if field == "json_object":
        if not msg.json_object:
            raise ValueError("structured_output.json_object must be true (leave structured_output unset for text)")
        return StructuredOutput("json_object")
    if field == "choice":
        return StructuredOutput.choice(list(msg.choice.choices))
    return StructuredOutput(next(k for k, f in _KIND_FIELDS.items() if f == field), getattr(msg, field))


def structured_to_proto(spec: StructuredOutput) -> pb.StructuredOutput:
    """Inverse of ``structured_from_proto``."""
    if spec.kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    if spec.kind == "choice":
        return pb.StructuredOutput(choice=pb.ChoiceList(choices=json.loads(spec.text)))
    return pb.StructuredOutput(**{_KIND_FIELDS[spec.kind]: spec.text})


def logprobs_to_proto(entries: Iterable[TokenLogprob | None]) -> list[pb.TokenLogprob]:
    """The wire's form of ``entries`` (a None, a token another worker sent before a continuation, becomes an
    empty entry)."""
    return [pb.TokenLogprob() if e is None else
            pb.TokenLogprob(token_id=e.token_id, logprob=e.logprob,
                            top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in e.top])
            for e in entries]  # fmt: skip
