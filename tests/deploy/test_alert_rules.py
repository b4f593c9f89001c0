"""The shipped alert rules (deploy/observability/prometheus/alerts.yml): promtool accepts them, each alert fires on
a bad series and not on a healthy one (promtool's unit tests, alerts_test.yml), and a threshold is one recording
rule: changing its number changes what fires."""

from __future__ import annotations

import subprocess

import yaml
from observability import RULE_TESTS, RULES, promtool


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=60)


def test_promtool_accepts_the_alert_rules():
    result = _run("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_each_alert_fires_on_a_bad_series_and_not_on_a_healthy_one():
    result = _run("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    alerts = {rule["alert"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
              if "alert" in rule}  # fmt: skip
    checks = [check for test in yaml.safe_load(RULE_TESTS.read_text())["tests"] for check in test["alert_rule_test"]]
    fired = {check["alertname"] for check in checks if check["exp_alerts"]}
    quiet = {check["alertname"] for check in checks if not check["exp_alerts"]}
    assert fired == alerts and quiet == alerts, "every alert needs a case where it fires and one where it does not"


def _hit_rate_case(tmp_path, threshold: str) -> subprocess.CompletedProcess:
    """promtool's verdict on "a worker at 94% for 11 minutes raises no alert" under ``threshold``."""
    rules = yaml.safe_load(RULES.read_text())
    [slo] = [r for g in rules["groups"] for r in g["rules"] if r.get("record") == "kvserve:slo:prefix_hit_rate"]
    slo["expr"] = threshold
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(rules))
    labels = '{job="kvserve-decode",instance="decode:51061",role="decode"}'
    series = [{"series": f"kvserve_prefix_cache_queries_tokens_total{labels}", "values": "0+100x20"},
              {"series": f"kvserve_prefix_cache_hits_tokens_total{labels}", "values": "0+94x20"}]  # fmt: skip
    quiet = [{"eval_time": "12m", "alertname": "KvservePrefixHitRateLow", "exp_alerts": []}]
    case = {"rule_files": ["alerts.yml"], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": quiet}]}  # fmt: skip
    (tmp_path / "case.yml").write_text(yaml.safe_dump(case))
    return _run("test", "rules", str(tmp_path / "case.yml"))


def test_the_hit_rate_threshold_is_the_number_its_recording_rule_holds(tmp_path):
    shipped = _hit_rate_case(tmp_path, "vector(0.95)")
    assert shipped.returncode != 0 and "KvservePrefixHitRateLow" in shipped.stdout + shipped.stderr  # it fires
    lowered = _hit_rate_case(tmp_path, "vector(0.93)")
    assert lowered.returncode == 0, lowered.stdout + lowered.stderr
