"""Preparing the bundled model: two processes at once convert it once and both get a complete directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine.bundled import resolve_model


@pytest.mark.soak  # ~18 s: pytest -m soak tests/cluster/test_bundled_model.py
def test_two_concurrent_prepares_convert_once(tmp_path):
    env = {**os.environ, "KVSERVE_CACHE": str(tmp_path)}
    cmd = [sys.executable, "-m", "kvserve.cli", "model", "prepare"]
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    ]
    results = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), results
    outs = {out.strip() for out, _ in results}
    assert outs == {str(tmp_path / "models" / "SmolLM2-135M-Instruct")}
    assert sum("converting bundled" in err for _, err in results) == 1  # the other waited on the lock
    model_dir = tmp_path / "models" / "SmolLM2-135M-Instruct"
    config = json.loads((model_dir / "config.json").read_text())
    assert config["rope_theta"] == 100000.0 and config["num_hidden_layers"] == 30
    assert [p.name for p in (tmp_path / "models").iterdir() if p.name.startswith(".SmolLM2-135M-Instruct-")] == []
    assert resolve_model(str(model_dir)) == model_dir
