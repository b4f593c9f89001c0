"""The shipped Grafana dashboard and Prometheus rules (deploy/observability/), read for the tests: their
PromQL expressions, the ``kvserve_*`` series each names with its label matchers, and promtool."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
OBSERVABILITY = ROOT / "deploy" / "observability"
DASHBOARD = OBSERVABILITY / "grafana" / "kvserve.json"
RULES = OBSERVABILITY / "prometheus" / "alerts.yml"
RULE_TESTS = OBSERVABILITY / "prometheus" / "alerts_test.yml"
# Grafana's range variables, as a plain duration, so that promtool can parse a panel's expression
GRAFANA_RANGES = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}

# a kvserve series (not a recording rule, ``kvserve:...``) and its optional {matchers}
_SELECTOR = re.compile(r"(?<![\w:])(kvserve_\w+)\s*(?:\{([^}]*)\})?")
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
_WORDS = re.compile(r"\w+(\|\w+)*")  # a regex that is only an alternation of literal words


@dataclass(frozen=True)
class Selector:
    """``name{label op "value", ...}`` as an expression wrote it."""

    name: str
    matchers: tuple[tuple[str, str, str], ...]

    def selects(self, labels: dict[str, str]) -> bool:
        """Whether a sample of this name with ``labels`` matches every matcher (PromQL's rules: anchored regexes,
        a missing label reads as empty)."""
        for label, op, value in self.matchers:
            have = labels.get(label, "")
            ok = {"=": have == value, "!=": have != value, "=~": re.fullmatch(value, have) is not None,
                  "!~": re.fullmatch(value, have) is None}[op]  # fmt: skip
            if not ok:
                return False
        return True

    def each_alternative(self) -> list[Selector]:
        """This selector once per word of each ``label=~"a|b|c"`` matcher (as ``label="a"``...): a misspelt
        alternative selects nothing, though the regex as a whole still selects the others."""
        choices = [[(label, "=", word) for word in value.split("|")] if op == "=~" and _WORDS.fullmatch(value)
                   else [(label, op, value)] for label, op, value in self.matchers]  # fmt: skip
        return [Selector(self.name, combination) for combination in itertools.product(*choices)]

    def __str__(self) -> str:
        matchers = ", ".join(f'{label}{op}"{value}"' for label, op, value in self.matchers)
        return f"{self.name}{{{matchers}}}" if matchers else self.name


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> dict[str, str]:
    """Every panel target's expression, by "panel TITLE, target REFID"."""
    return {f"panel {panel['title']!r}, target {target['refId']}": target["expr"]
            for panel in dashboard()["panels"] for target in panel.get("targets", [])}  # fmt: skip


def rule_exprs() -> dict[str, str]:
    """Every rule's expression, by the name it records or alerts as."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule.get("alert") or rule["record"]: rule["expr"] for group in groups for rule in group["rules"]}


def selectors(expr: str) -> list[Selector]:
    return [Selector(name, tuple(_MATCHER.findall(matchers or ""))) for name, matchers in _SELECTOR.findall(expr)]


def promql(expr: str) -> str:
    """A dashboard expression with Grafana's range variables replaced: plain PromQL."""
    for variable, duration in GRAFANA_RANGES.items():
        expr = expr.replace(variable, duration)
    return expr


def promtool() -> str:
    found = shutil.which("promtool") or shutil.which("promtool", path=str(Path(sys.executable).parent))
    assert found, "promtool is not installed: `make install` unpacks it from Debian's prometheus package"
    return found
