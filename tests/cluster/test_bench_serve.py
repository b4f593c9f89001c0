"""``kvserve bench serve`` on the CPU: a real 1P+1D cluster against the offline engine, same greedy tokens."""

from __future__ import annotations

import subprocess
import sys

import pytest


# on demand (~15 s): pytest -m soak tests/cluster/test_bench_serve.py;
# clusters equal the offline engine in test_cluster.py
@pytest.mark.soak
def test_bench_serve_reports_latencies_hand_off_and_equal_tokens():
    cmd = [sys.executable, "-m", "kvserve.cli", "bench", "serve", "--num-prompts", "2", "--prompt-len", "24",
           "--max-tokens", "4", "--handoff-tokens", "48", "--handoff-prompts", "1"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = done.stdout
    assert "1P+1D cluster (shm)" in out and "offline engine" in out
    assert "hand-off of a 48-token prompt (shm" in out
    assert "greedy tokens: cluster == offline engine for 3/3 prompts" in out
