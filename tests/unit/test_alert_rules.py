"""The shipped alerting rules and dashboard: promtool accepts the rules, their unit tests pass
(each alert fires above its threshold and stays quiet below), those unit tests fail when a
threshold moves, and every metric the rules and the dashboard name is one RouterMetrics
exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from engine.router.metrics import RouterMetrics

pytestmark = pytest.mark.unit

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "prometheus" / "strata-alerts.yml"
RULE_TESTS = DEPLOY / "prometheus" / "strata-alerts.test.yml"
DASHBOARD = DEPLOY / "grafana" / "strata-dashboard.json"
NAME = re.compile(r"\bstrata_[a-z0-9_]+")
ALERTS = {
    "StrataPrefillPoolSaturated",
    "StrataDecodePoolSaturated",
    "StrataNoWorkers",
    "StrataTtftSloBreached",
    "StrataTpotSloBreached",
    "StrataKvPullSlow",
    "StrataHighRefusalRate",
    "StrataProfileDrift",
}


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool is not on PATH (Debian's prometheus package; scripts/test installs it)"
        )
    return path


def run_promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def exported_names() -> set[str]:
    """Every series name a scrape of RouterMetrics can carry (families with their suffixes)."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "gauge": ("",),
    }
    names: set[str] = set()
    for family in RouterMetrics().registry.collect():
        names.update(family.name + s for s in suffixes[family.type])
    return names


def rule_exprs() -> dict[str, str]:
    doc = yaml.safe_load(RULES.read_text())
    return {r["alert"]: r["expr"] for g in doc["groups"] for r in g["rules"]}


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def test_promtool_checks_the_rules() -> None:
    out = run_promtool("check", "rules", str(RULES), cwd=RULES.parent)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in out.stdout
    assert set(rule_exprs()) == ALERTS


def test_every_alert_fires_above_and_not_below_its_threshold() -> None:
    out = run_promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert out.returncode == 0, out.stdout + out.stderr
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    assert tested == ALERTS


@pytest.mark.parametrize(
    ("original", "mutated"),
    [
        ('{pool="prefill"}) > 0.8', '{pool="prefill"}) > 0.78'),  # 79% would fire
        ('{pool="prefill"}) > 0.8', '{pool="prefill"}) > 0.82'),  # 81% would not
        ('{pool="decode"}) > 0.85', '{pool="decode"}) > 0.87'),
        ("for: 10m", "for: 8m"),  # decode fires at 9m
        ("1.5 * max by (slo_class) (strata_router_slo_ttft_seconds)",
         "2.5 * max by (slo_class) (strata_router_slo_ttft_seconds)"),
        ("max by (tier) (strata_router_kv_pull_budget_seconds)",
         "3 * max by (tier) (strata_router_kv_pull_budget_seconds)"),
        ("> 0.1\n", "> 0.05\n"),  # bulk's 8% would fire
        ("(strata_router_pool_workers) == 0", "(strata_router_pool_workers) <= 1"),
    ],
)  # fmt: skip
def test_the_rule_tests_catch_a_moved_threshold(
    tmp_path: Path, original: str, mutated: str
) -> None:
    text = RULES.read_text()
    assert original in text
    (tmp_path / RULES.name).write_text(text.replace(original, mutated, 1))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    out = run_promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert out.returncode != 0, f"the rule tests still pass with {mutated!r}"
    assert "FAILED" in out.stdout + out.stderr


def test_every_metric_named_by_rules_and_dashboard_is_exported() -> None:
    exported = exported_names()
    referenced: dict[str, set[str]] = {}
    for alert, expr in rule_exprs().items():
        for name in NAME.findall(expr):
            referenced.setdefault(name, set()).add(f"rule {alert}")
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    for expr in exprs:
        for name in NAME.findall(expr):
            referenced.setdefault(name, set()).add("dashboard")
    missing = {name: where for name, where in referenced.items() if name not in exported}
    assert not missing, f"not exported by RouterMetrics: {missing}"
    # The rules alone must cover the issue's four alerts' inputs.
    assert {
        "strata_router_pool_utilization",
        "strata_router_kv_pull_seconds_bucket",
        "strata_router_kv_pull_budget_seconds",
        "strata_router_ttft_seconds_bucket",
        "strata_router_slo_ttft_seconds",
        "strata_router_pool_workers",
        "strata_router_admission_decisions_total",
    } <= set(referenced)
    # And a name RouterMetrics does not export is caught.
    assert "strata_router_prefill_seconds_total" not in exported


def test_dashboard_has_a_row_per_group_and_every_panel_queries() -> None:
    dash = json.loads(DASHBOARD.read_text())
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    assert rows == ["Prefill pool", "Decode pool", "KV movement", "End to end"]
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert all(p["targets"] and all(t["expr"] for t in p["targets"]) for p in panels)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24
