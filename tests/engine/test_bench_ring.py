"""``kvserve bench ring`` end to end on a tiny window: the ring's blocks stop growing, the three caches agree
where the window still holds everything, and the PNG and JSON exist."""

from __future__ import annotations

import json

import pytest

from kvserve.cli import main
from kvstore.ring import RingSpec


# on demand (~9 s): pytest -m soak tests/engine/test_bench_ring.py; test_streaming.py checks the ring's flat memory
@pytest.mark.soak
def test_ring_bench_writes_its_plot_and_its_ring_stays_flat(tmp_path, capsys):
    png, out = tmp_path / "ring.png", tmp_path / "ring.json"
    main(["bench", "ring", "--tokens", "96", "--every", "32", "--sinks", "4", "--window", "28", "--ppl-tokens", "160",
          "--bucket", "32", "--plot", str(png), "--save-result", str(out)])  # fmt: skip
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads(out.read_text())
    assert [r["tokens"] for r in result["generate"]] == [32, 64, 96]
    held = [r["blocks"] for r in result["generate"]]  # 13 prompt + 96 tokens through 1 sink + 4 ring blocks
    assert held[1:] == [RingSpec(4, 28, 16).max_blocks] * 2 == [5, 5]
    first = result["perplexity"][0]  # positions 1-32: every cache still holds every earlier token
    assert first["sinks+window"] == pytest.approx(first["full"], rel=1e-4)
    assert first["window only"] == pytest.approx(first["full"], rel=1e-4)
    assert "window only" in capsys.readouterr().out
