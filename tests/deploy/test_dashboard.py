"""The shipped Grafana dashboard (deploy/observability/grafana/kvserve.json): a dashboard Grafana can load, on a
Prometheus chosen by its ``${datasource}`` variable, whose every panel expression is PromQL, with the panels
issue 31 asks for. Whether the workers export what it names: tests/cluster/test_observability_series.py."""

from __future__ import annotations

import subprocess

import yaml
from observability import dashboard, dashboard_exprs, promql, promtool, selectors

PROMETHEUS = {"type": "prometheus", "uid": "${datasource}"}


def test_every_panel_queries_the_datasource_variable_with_ids_and_places_of_its_own():
    board = dashboard()
    assert board["uid"] == "kvserve" and board["title"] and board["schemaVersion"] >= 36
    [variable] = [v for v in board["templating"]["list"] if v["name"] == "datasource"]
    assert variable["type"] == "datasource" and variable["query"] == "prometheus"
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels) and all(isinstance(p["id"], int) for p in panels)
    cells = set()
    for panel in panels:
        name = panel["title"]
        assert panel["datasource"] == PROMETHEUS, name
        assert panel["targets"], f"{name} has no query"
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), name
        for target in panel["targets"]:
            assert target["datasource"] == PROMETHEUS and target["expr"].strip(), name
        box = panel["gridPos"]
        assert {k: type(box[k]) for k in "hwxy"} == dict.fromkeys("hwxy", int) and box["x"] + box["w"] <= 24, name
        covered = {(x, y) for x in range(box["x"], box["x"] + box["w"]) for y in range(box["y"], box["y"] + box["h"])}
        assert not covered & cells, f"{name} overlaps another panel"
        cells |= covered


def test_every_panel_expression_is_promql(tmp_path):
    """promtool parses each target's expression (Grafana's range variables made plain durations) as a rule."""
    exprs = dashboard_exprs()
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"panel:expr_{i}", "expr": promql(expr)}
                                                        for i, expr in enumerate(exprs.values())]}]}  # fmt: skip
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in result.stdout + result.stderr


def test_the_panels_show_what_issue_31_asks_for():
    named = {str(s) if s.name == "kvserve_worker_state" else s.name
             for expr in dashboard_exprs().values() for s in selectors(expr)}  # fmt: skip
    wanted = {
        "latency": {"kvserve_time_to_first_token_seconds_bucket", "kvserve_time_per_output_token_seconds_bucket"},
        "queue depth": {'kvserve_worker_state{field=~"requests_waiting|requests_running"}'},
        "KV per tier": {'kvserve_worker_state{field="kv_blocks_used"}', 'kvserve_worker_state{field="kv_blocks_free"}',
                        'kvserve_worker_state{field="kv_host_blocks_cached"}',
                        'kvserve_worker_state{field="kv_host_blocks_free"}'},
        "prefix hits": {"kvserve_prefix_cache_hits_tokens_total", "kvserve_prefix_cache_queries_tokens_total",
                        "kvserve_kv_tier_hit_tokens_total"},
        "hand-off": {"kvserve_kv_transfer_bytes_total", "kvserve_kv_handoff_seconds_bucket"},
        "preemptions and swaps": {"kvserve_preemptions_total", "kvserve_kv_preemptions_by_mode_total",
                                  "kvserve_kv_tier_blocks_total"},
        "speculation": {"kvserve_spec_accepted_tokens_total", "kvserve_spec_proposed_tokens_total"},
        "migrations": {"kvserve_router_stream_migrations_total"},
        "bound by": {"kvserve_step_utilization"},
        "Redis": {"kvserve_registry_up"},
    }  # fmt: skip
    missing = {what: names - named for what, names in wanted.items() if names - named}
    assert not missing, missing
    [bound_by] = [e for e in dashboard_exprs().values() if "kvserve_step_utilization" in e]
    [selector] = selectors(bound_by)
    assert selector.matchers == (("resource", "=~", "memory_bandwidth|compute|host"),)
