"""The committed stubs are exactly what the generator produces from the .proto files."""

from __future__ import annotations

from pathlib import Path

from protos.generate import ROOT, generate


def test_regenerating_stubs_changes_nothing(tmp_path):
    for path in generate(tmp_path):
        committed = ROOT / path.relative_to(tmp_path)
        assert committed.is_file(), f"{committed} is not committed"
        assert committed.read_text() == path.read_text(), f"{committed} is stale: run python -m protos.generate"
    assert Path(ROOT / "kvserve/v1/kvserve_pb2_grpc.py").is_file()


def test_sampling_options_round_trip():
    """What the decode worker sends a prefill worker is read back as the same settings, seed included
    (floats travel as float32, so the values here are exact in float32)."""
    from engine import SamplingParams
    from rpc.convert import sampling_from_proto, sampling_to_proto

    params = SamplingParams(temperature=0.75, top_p=0.875, top_k=20, seed=11, max_tokens=5, repetition_penalty=1.25,
                            stop=["\n\n"], stop_token_ids=[2, 7], ignore_eos=True)  # fmt: skip
    back = sampling_from_proto(sampling_to_proto(params))
    assert back == params
    assert sampling_from_proto(sampling_to_proto(SamplingParams())).seed is None
