"""``kvserve up`` starts a whole cluster, answers, and stops cleanly on SIGTERM with no process left behind."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from cluster_utils import free_base_port

from kvserve.client import Client


def _processes_mentioning(text: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", "--", text], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def test_up_serves_then_stops_cleanly(tmp_path):
    port = free_base_port()
    cmd = [sys.executable, "-m", "kvserve.cli", "up", "--port", str(port), "--num-blocks", "64",
           "--log-dir", str(tmp_path)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "serving kvserve.v1.Inference" in line:
                break
            assert time.monotonic() < deadline, "".join(lines)
        assert f"127.0.0.1:{port}" in lines[-1]
        assert lines[-4:-1] == [f"decode-0 decode grpc=127.0.0.1:{port + 10} metrics=-\n",
                                f"prefill-0 prefill grpc=127.0.0.1:{port + 30} metrics=-\n",
                                f"router router grpc=127.0.0.1:{port} metrics=-\n"]  # fmt: skip
        with Client(f"127.0.0.1:{port}", timeout_s=60) as client:
            result = client.generate("Hello", max_tokens=4, ignore_eos=True)
        assert len(result.token_ids) == 4 and result.transfer_backend == "shm"
        assert _processes_mentioning(f"--port {port + 10}")  # the decode worker is up
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert "cluster stopped" in proc.stdout.read()
    for worker_port in (port, port + 10, port + 30):
        assert not _processes_mentioning(f"--port {worker_port}"), (
            f"a process on port {worker_port} outlived the cluster"
        )
