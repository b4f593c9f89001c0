"""``kvserve bench tiers`` end to end at a toy size: three engines (a small pool without a host tier, the same
pool with one, a pool for everything) answer every turn alike, the host tier serves hits, and the PNG and
JSON exist."""

from __future__ import annotations

import json

import pytest

from kvserve.bench.tiers import FLOOR
from kvserve.cli import main


# on demand (~25 s): pytest -m soak tests/engine/test_bench_tiers.py; test_tiers.py checks that tier hits, swaps and
# recomputes give the same tokens
@pytest.mark.soak
def test_tiers_bench_compares_three_pools_on_the_same_turns(tmp_path, capsys):
    png, out = tmp_path / "tiers.png", tmp_path / "tiers.json"
    main(["bench", "tiers", "--users", "3", "--turns", "3", "--turn-tokens", "40", "--device-fraction", "0.5",
          "--host-gb", "0.05", "--skip-resume", "--plot", str(png), "--save-result", str(out)])  # fmt: skip
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    mt = json.loads(out.read_text())["multi_turn"]
    assert mt["same_tokens"] and mt["host_hits"] > 0  # turn 2 on: the others evicted most of a user's history
    assert len(mt["rows"]) == 9 and mt["num_blocks"] == 11  # half of 3 x 3 x 40 tokens
    for side in ("without", "with L2", FLOOR):
        assert 0 < mt[side]["ttft_p50_s"] <= mt[side]["ttft_p99_s"]
    assert "the floor" in capsys.readouterr().out
