"""``--config FILE`` in real processes: a worker runs with what the file gives it (its section over the top
level), and ``kvserve up`` refuses a bad file with one line and exit status 2 before it starts anything."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from cluster_utils import free_base_port, prometheus_values


def test_a_worker_runs_with_the_values_of_its_file(tiny_model_dir, tmp_path):
    port = free_base_port() + 30
    path = tmp_path / "kvserve.toml"
    path.write_text(f'model = "{tiny_model_dir}"\nskip_tokenizer_init = true\nnum_blocks = 24\n\n'
                    f"[prefill]\nnum_blocks = 40\nport = {port}\nmetrics_port = {port + 1000}\nthreads = 1\n"
                    "insecure_internal = true\n")  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("KVSERVE_NUM_BLOCKS", None)
    log = tmp_path / "prefill.log"
    with log.open("w") as out:
        worker = subprocess.Popen([sys.executable, "-m", "prefill_service", "--config", str(path)], env=env,
                                  stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    free_blocks = 'field="kv_blocks_free",role="prefill"'
    try:
        deadline = time.monotonic() + 120
        state: dict[str, float] = {}
        while free_blocks not in state:  # (its /metrics may answer before the engine's gauges are there)
            assert worker.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the worker did not report its KV blocks in time"
            time.sleep(0.5)
            try:
                state = prometheus_values(f"http://127.0.0.1:{port + 1000}/metrics", "kvserve_worker_state")
            except OSError:
                pass
        assert state[free_blocks] == 40  # its section's, over the top level's 24
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)


def test_kvserve_up_refuses_a_bad_file_before_it_starts_anything(tmp_path):
    path = tmp_path / "kvserve.yaml"
    path.write_text("num_blocks: 64\ndecode:\n  max_waiting: -1\n")
    cmd = [sys.executable, "-m", "kvserve.cli", "up", "--port", str(free_base_port()), "--config", str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"kvserve: decode-0: {path}: decode.max_waiting: invalid value -1: Input should be greater than or equal " \
           "to 0" in done.stderr  # fmt: skip
    assert "starting" not in done.stdout
