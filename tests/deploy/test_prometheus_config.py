"""The shipped Prometheus config (``prometheus.yml``, for the ``prom/prometheus:v3`` image that
docker-compose.yml pins) is one that Prometheus loads: ``promtool check config`` accepts it and the alert rules
it names (their own tests: test_alert_rules.py)."""

from __future__ import annotations

import subprocess

import yaml
from observability import ROOT, RULES, promtool


def test_promtool_accepts_the_shipped_prometheus_config_and_the_rules_it_loads(tmp_path):
    result = subprocess.run([promtool(), "check", "config", str(ROOT / "prometheus.yml")], capture_output=True,
                            text=True)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr
    assert f"Checking {RULES}\n  SUCCESS" in result.stdout + result.stderr  # rule_files: the alert rules, checked


def test_promtool_refuses_a_broken_config(tmp_path):
    """The check can fail: a scrape job without a name is refused."""
    config = yaml.safe_load((ROOT / "prometheus.yml").read_text())
    del config["scrape_configs"][0]["job_name"]
    broken = tmp_path / "prometheus.yml"
    broken.write_text(yaml.safe_dump(config))
    result = subprocess.run([promtool(), "check", "config", str(broken)], capture_output=True, text=True)
    assert result.returncode != 0 and "job_name" in result.stdout + result.stderr


def test_compose_pins_prometheus_to_the_major_version_the_config_is_written_for():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert compose["services"]["prometheus"]["image"] == "prom/prometheus:v3"
    assert "Prometheus 3" in (ROOT / "prometheus.yml").read_text().splitlines()[0]
