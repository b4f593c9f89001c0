"""``kvserve bench transfer``: every transport's hand-off, checked by the destination's checksum, in one process
and with its two ends on two test hosts (network namespaces). In child processes: NIXL must not load here
(tests/cluster/test_transfer_nixl.py says why)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from kvserve.testing import netns
from transfer.backend import nixl_installed


def _bench(*args: str) -> str:
    cmd = [sys.executable, "-m", "kvserve.cli", "bench", "transfer", "--tokens", "64", "--repeats", "2", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def _rows(out: str) -> dict[str, tuple[float, float]]:
    """transport -> (latency ms, GB/s) of the table."""
    rows = re.finditer(r"^(shm|grpc|nixl|tcp) +([\d.]+) +([\d.]+)$", out, re.M)
    return {m[1]: (float(m[2]), float(m[3])) for m in rows}


def test_in_one_process_every_transport_here_moves_the_blocks():
    out = _bench()
    expected = {"shm", "grpc", *(["nixl"] if nixl_installed() else [])}
    rows = _rows(out)
    assert set(rows) == expected and all(ms > 0 and gbs > 0 for ms, gbs in rows.values()), out
    assert "64 tokens of LlamaForCausalLM KV on cpu: 2.8 MiB" in out
    assert re.search(r"^shm is [\d.]+x as fast as grpc for this hand-off$", out, re.M), out


# ~10 s: pytest -m soak tests/cluster/test_bench_transfer.py (test_multihost.py moves KV across hosts)
@pytest.mark.soak
def test_across_two_hosts_grpc_and_nixl_cross_the_link_and_shm_cannot():
    if reason := netns.unavailable():
        pytest.skip(reason)
    out = _bench("--netns")  # grpc, nixl where installed, and a plain TCP copy as the link's reference
    transports = ["grpc", *(["nixl"] if nixl_installed() else []), "tcp"]
    assert set(_rows(out)) == set(transports), out
    assert re.search(r"^grpc moves at \d+% of a plain TCP copy's speed over this link$", out, re.M), out
    assert "two network namespaces on a bridge, each with a /dev/shm of its own" in out
    assert not netns.remove_leftovers()  # the bench removed its hosts itself
    cmd = [sys.executable, "-m", "kvserve.cli", "bench", "transfer", "--netns", "--transport", "shm"]
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "not available here: shm (shm: CPU only, one host" in refused.stderr
