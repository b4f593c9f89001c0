"""The mapping between the wire's sampling options and the engine's ``SamplingParams``."""

from __future__ import annotations

from engine import SamplingParams
from protos.kvserve.v1 import kvserve_pb2 as pb


def sampling_from_proto(opts: pb.SamplingOptions) -> SamplingParams:
    """Unset fields take ``SamplingParams``' defaults; invalid values raise ``ValueError`` with the reason."""
    kwargs = {}
    for name in ("temperature", "top_p", "top_k", "seed", "max_tokens", "repetition_penalty", "streaming_window",
                 "streaming_sinks", "speculative"):  # fmt: skip
        if opts.HasField(name):
            kwargs[name] = getattr(opts, name)
    return SamplingParams(
        stop=list(opts.stop), stop_token_ids=list(opts.stop_token_ids), ignore_eos=opts.ignore_eos, **kwargs
    )


def sampling_to_proto(params: SamplingParams) -> pb.SamplingOptions:
    """Inverse of ``sampling_from_proto``: every field set, so the receiver sees exactly these settings."""
    opts = pb.SamplingOptions(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                              max_tokens=params.max_tokens, repetition_penalty=params.repetition_penalty,
                              stop=params.stop, stop_token_ids=params.stop_token_ids,
                              ignore_eos=params.ignore_eos, speculative=params.speculative)  # fmt: skip
    for name in ("seed", "streaming_window", "streaming_sinks"):  # None: unset, so the receiver's default holds
        if getattr(params, name) is not None:
            setattr(opts, name, getattr(params, name))
    return opts
