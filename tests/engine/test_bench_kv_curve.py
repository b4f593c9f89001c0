"""``kvserve bench kv-curve`` end to end on tiny lengths: both sides make the same tokens, the PNG and JSON exist."""

from __future__ import annotations

import json

from kvserve.cli import main


def test_kv_curve_writes_its_plot_and_both_sides_agree(tmp_path, capsys):
    png, out = tmp_path / "curve.png", tmp_path / "curve.json"
    main(["bench", "kv-curve", "--lengths", "16,40", "--steps", "3", "--plot", str(png), "--save-result", str(out)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = json.loads(out.read_text())["rows"]
    assert [r["length"] for r in rows] == [16, 40]
    assert all(r["same_tokens"] for r in rows)  # cached decode and full recomputation give the same greedy tokens
    assert rows[1]["kv_mib"] == 2.5 * rows[0]["kv_mib"] > 0  # memory grows linearly with the length
    assert "same tokens" in capsys.readouterr().out
