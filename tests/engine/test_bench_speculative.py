"""``kvserve bench offline --speculative ngram`` at a toy size: both engines give the same tokens, the copy
workload's guesses are accepted, and the repeating-noise workload proposes at all (else it would not test the
off-switch)."""

from __future__ import annotations

import json

import pytest

from kvserve.cli import main


# on demand (~30 s): pytest -m soak tests/engine/test_bench_speculative.py; test_speculative.py checks the tokens
@pytest.mark.soak
def test_speculative_bench_rows(tmp_path, capsys):
    out = tmp_path / "spec.json"
    for only in ("copy, batch 1", "repeating"):
        main(["bench", "offline", "--speculative", "ngram", "--max-tokens", "24", "--spec-rounds", "1",
              "--only", only, "--save-result", str(out)])  # fmt: skip
        [row] = json.loads(out.read_text())["rows"]
        assert row["same tokens"] and row["plain tok/s"] > 0 and row["ngram tok/s"] > 0
        if only.startswith("copy"):
            assert row["acceptance rate"] > 0.3 and row["mean accepted length"] > 1
        else:
            assert row["proposed"] > 0 and row["acceptance rate"] < 0.5  # guesses were made, and most were wrong
    assert "tokens accepted per verify step" in capsys.readouterr().out
