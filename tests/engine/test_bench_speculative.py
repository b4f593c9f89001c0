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


def test_first_difference_names_the_token_and_the_plain_sides_two_best_candidates(engine_prompts):
    from engine import LLM, SamplingParams
    from kvserve.bench.speculative import first_difference

    llm = LLM("default", num_blocks=64)
    prompts = [engine_prompts[0], engine_prompts[1]]
    plain = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))]
    ngram = [list(plain[0]), [*plain[1][:3], (plain[1][3] + 1) % 1000, *plain[1][4:]]]
    assert first_difference(llm, prompts, plain, [list(p) for p in plain]) is None
    report = first_difference(llm, prompts, plain, ngram)
    assert report.startswith(f"request 1, token 3: plain {plain[1][3]}, ngram {ngram[1][3]}; plain's two best there "
                             f"{plain[1][3]} (")  # the greedy token is the best of the logprobs rerun
    assert "nats apart" in report and "differ before it" not in report
    assert first_difference(llm, prompts, plain, [plain[0], plain[1][:5]]) == (
        "request 1: one side stopped at token 5, the other went on")
