"""``kvserve up`` starts a whole cluster, answers, and stops cleanly on SIGTERM with no process left behind; no
secret of the cluster (token, Redis password, API key) shows on a command line, in its output or its logs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import unquote, urlsplit

from cluster_utils import free_base_port

from engine import EngineConfig
from kvserve.client import Client
from kvserve.launcher.scratch import cluster_shm_dir
from rpc.options import REDIS_URL_ENV
from rpc.settings import settings_from_argv
from security.auth import TOKEN_ENV, TOKEN_FILE_ENV


def _processes_mentioning(text: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", "--", text], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def _scrape(url: str, api_key: str | None = None) -> dict[str, float]:
    """``/metrics`` as {sample with labels: value}."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    text = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10).read().decode()
    return {name: float(value) for line in text.splitlines() if line and not line.startswith("#")
            for name, value in [line.rsplit(" ", 1)]}  # fmt: skip


def _command_line(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")


def _engine_config_of(worker_port: int) -> EngineConfig:
    """The engine settings the worker listening on ``worker_port`` was started with, read from its command line."""
    [line] = _processes_mentioning(f"--port {worker_port}")
    return settings_from_argv(EngineConfig, line.split()[4:])  # after "PID PYTHON -m ROLE_service"


def _descendants(pid: int) -> list[int]:
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [p for child in map(int, children) for p in (child, *_descendants(child))]


def _redis_password(pid: int) -> str:
    """The Redis password in worker ``pid``'s environment (``KVSERVE_REDIS_URL``), where it belongs."""
    environ = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in v)
    return unquote(urlsplit(environ[REDIS_URL_ENV]).password)


def test_up_serves_then_stops_cleanly(tmp_path):
    port = free_base_port()
    logs, token_file, api_key = tmp_path / "logs" / "up", tmp_path / "cluster-token", "api-key-0123456789"
    # (logs does not exist yet: kvserve up makes it)
    token_file.write_text("cluster-token-0123456789\n")
    token_file.chmod(0o600)
    cmd = [sys.executable, "-m", "kvserve.cli", "up", "--port", str(port), "--http-port", str(port + 1),
           "--num-blocks", "64", "--log-dir", str(logs), "--prefill-gpu-memory-utilization", "0.3",
           "--decode-gpu-memory-utilization", "0.45", "--cluster-token-file", str(token_file)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TOKEN_FILE_ENV, REDIS_URL_ENV)}
    env |= {"KVSERVE_API_KEY": api_key}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    secrets = ["cluster-token-0123456789", api_key]
    try:
        deadline = time.monotonic() + 180
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "serving kvserve.v1.Inference" in line:
                break
            assert time.monotonic() < deadline, "".join(lines)
        assert f"127.0.0.1:{port}" in lines[-1]
        decode_metrics = f"http://127.0.0.1:{port + 1010}/metrics"
        assert lines[-4:-1] == [f"decode-0 decode grpc=127.0.0.1:{port + 10} metrics={decode_metrics}\n",
                                f"prefill-0 prefill grpc=127.0.0.1:{port + 30} "
                                f"metrics=http://127.0.0.1:{port + 1030}/metrics\n",
                                f"router router grpc=127.0.0.1:{port} "
                                f"metrics=http://127.0.0.1:{port + 1}/metrics\n"]  # fmt: skip
        before = _scrape(decode_metrics)
        with Client(f"127.0.0.1:{port}", timeout_s=60, api_key=api_key) as client:
            result = client.generate("Hello", max_tokens=4, ignore_eos=True)
        assert len(result.token_ids) == 4 and result.transfer_backend == "shm"
        after = _scrape(decode_metrics)  # the metrics moved with the request
        finished = 'kvserve_requests_total{outcome="finished",role="decode"}'
        assert after[finished] == before.get(finished, 0) + 1
        ttft = "kvserve_time_to_first_token_seconds_count"
        assert after[ttft] == before[ttft] + 1
        assert after["kvserve_inter_token_latency_seconds_count"] >= 3
        assert after['kvserve_kv_transfer_bytes_total{backend="shm"}'] > 0
        assert after['kvserve_worker_state{field="kv_blocks_used",role="decode"}'] == 0  # all freed again
        routed = _scrape(f"http://127.0.0.1:{port + 1}/metrics", api_key)  # the router's, on its HTTP port
        assert routed['kvserve_router_requests_total{status="OK"}'] == 1
        assert sum(v for k, v in routed.items() if k.startswith("kvserve_router_decisions_total")) == 1
        assert _engine_config_of(port + 10).gpu_memory_utilization == 0.45  # each role got its own share
        assert _engine_config_of(port + 30).gpu_memory_utilization == 0.3
        children = _descendants(proc.pid)  # Redis, both workers, the router
        [decode_pid] = [pid for pid in children if f"--port {port + 10}" in _command_line(pid)]
        secrets.append(_redis_password(decode_pid))
        for pid in children:
            assert not [s for s in secrets if s in _command_line(pid)], f"a secret on {_command_line(pid)!r}"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    output = "".join(lines) + proc.stdout.read()
    assert "cluster stopped" in output
    assert not cluster_shm_dir(port).exists()  # its pools, Redis's socket and the certificates went with it
    for name, text in [("the launcher's output", output), *((p.name, p.read_text()) for p in logs.iterdir())]:
        assert not [s for s in secrets if s in text], f"a secret in {name}"
    for worker_port in (port, port + 10, port + 30):
        assert not _processes_mentioning(f"--port {worker_port}"), (
            f"a process on port {worker_port} outlived the cluster"
        )


def test_up_refuses_gpu_shares_over_the_whole_gpu():
    cmd = [sys.executable, "-m", "kvserve.cli", "up", "--port", str(free_base_port()),
           "--prefill-gpu-memory-utilization", "0.6", "--decode-gpu-memory-utilization", "0.6"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "add up to more than the whole GPU" in done.stderr
    assert "serving" not in done.stdout
