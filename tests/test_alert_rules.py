"""The chart's alert rules, unit-tested by Prometheus itself: `promtool test rules` runs
deploy/prometheus/alerts_test.yaml against the PrometheusRule's groups as `helm template`
renders them (default thresholds), so an alert's PromQL, its `for`, labels and annotations
are checked on series that should fire it and on near misses that should not. promtool comes
with Debian's `prometheus` package (`bash deploy/install-tools.sh`); test_dashboard.py checks
the other half: every metric the rules query is one the gateway exports. The queue alert is
rendered whenever a queue is configured, a model's own included."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from tests.support.k8s_tools import ROOT, load_manifests, one, run, tool

TESTS = ROOT / "deploy" / "prometheus" / "alerts_test.yaml"
CHART = ROOT / "helm" / "furnace-gateway"


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is missing: run `bash deploy/install-tools.sh` first", pytrace=False)
    return path


def rendered_groups() -> list[dict[str, object]]:
    """The PrometheusRule's groups, with the queue alert on (`gateway.config.queue`)."""
    output = run(
        [
            tool("helm"),
            "template",
            "llm",
            str(CHART),
            "--set",
            "prometheusRule.enabled=true",
            "--set-json",
            'gateway.config.queue={"max_wait": 2}',
        ]
    ).stdout
    rule = one(load_manifests(output), "PrometheusRule", "llm-furnace-gateway")
    groups: list[dict[str, object]] = rule["spec"]["groups"]
    return groups


def test_promtool_passes_the_alert_rules_unit_tests(tmp_path: Path):
    (tmp_path / "alerts.rules.yaml").write_text(yaml.safe_dump({"groups": rendered_groups()}))
    shutil.copy(TESTS, tmp_path / TESTS.name)
    result = run([promtool(), "check", "rules", str(tmp_path / "alerts.rules.yaml")])
    assert "SUCCESS" in result.stdout
    result = run([promtool(), "test", "rules", str(tmp_path / TESTS.name)])
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_test_that_fires_it():
    alerts = {rule["alert"] for group in rendered_groups() for rule in group["rules"]}
    fired = {
        case["alertname"]
        for test in yaml.safe_load(TESTS.read_text())["tests"]
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert alerts == fired


@pytest.mark.parametrize(
    ("queue", "alerted"),
    [
        ((), False),
        (("--set-json", 'gateway.config.queue={"max_wait": 300}'), True),
        # a model's own queue alone: the alert must come with it too
        (
            (
                "--set-json",
                'models=[{"name": "furnace-demo", "pools": ["demo"], "queue": {"max_wait": 300}}]',
            ),
            True,
        ),
    ],
)
def test_the_queue_alert_comes_with_any_queue(queue: tuple[str, ...], alerted: bool):
    """The queue alert reads waits as shares of each model's own max_wait, so it needs no
    max_wait of its own: rendered whenever any queue is configured, top-level or a model's."""
    args = [tool("helm"), "template", "llm", str(CHART), "--set", "prometheusRule.enabled=true"]
    rule = one(load_manifests(run([*args, *queue]).stdout), "PrometheusRule", "llm-furnace-gateway")
    rules = {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}
    assert ("FurnaceGatewayQueueWaitNearMax" in rules) == alerted
    if alerted:
        assert "300" not in rules["FurnaceGatewayQueueWaitNearMax"]["expr"]
