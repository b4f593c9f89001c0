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
