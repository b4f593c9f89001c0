"""docker-compose.yml and its Prometheus scrape config describe the same processes, and compose accepts the file."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_docker_compose_config_validates(tmp_path):
    if shutil.which("docker-compose") is None:
        pytest.skip("the docker-compose command is not installed (Debian: apt install docker-compose)")
    token = ROOT / "cluster-token"
    made = not token.exists()
    if made:  # the compose secret's file must exist for `config` to accept it
        token.write_text("compose-config-test\n")
    try:
        result = subprocess.run(["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
                                capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    finally:
        if made:
            token.unlink()
    assert result.returncode == 0, result.stderr


def test_prometheus_scrapes_every_process_on_its_metrics_port():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    scrape = yaml.safe_load((ROOT / "prometheus.yml").read_text())
    targets = {t for job in scrape["scrape_configs"] for group in job["static_configs"] for t in group["targets"]}
    expected = set()
    for name in ("decode", "prefill"):
        command = compose["services"][name]["command"]
        expected.add(f"{name}:{command[command.index('--metrics-port') + 1]}")
    assert "8000:8000" in compose["services"]["router"]["ports"]
    assert targets == expected | {"router:8000"}
