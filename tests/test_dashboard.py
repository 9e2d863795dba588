"""The operator's view shipped with the chart: the Grafana dashboard (a ConfigMap for
Grafana's sidecar, and the same JSON in deploy/grafana/) and the PrometheusRule's alerts.
Every metric a panel or an alert queries is one a real gateway exports: the test scrapes
one that has served traffic and checks each name the PromQL expressions use."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import QueueConfig, RoutingConfig
from tests.support.k8s_tools import ROOT, load_manifests, one, run, tool
from tests.support.keys import bearer, keyed, new_key
from tests.support.servers import make_config
from tests.support.waiting import HANG_GUARD

DASHBOARD = ROOT / "deploy" / "grafana" / "furnace-gateway.json"
CHART = ROOT / "helm" / "furnace-gateway"
METRIC = re.compile(r"\bfurnace_gateway_[a-z0-9_]+\b")
#: What an operator looks for first, each a row of the dashboard.
ROWS = {
    "Traffic",
    "Latency",
    "Errors",
    "Slots and queue",
    "Workers",
    "Teams",
    "Tensor models",
    "Usage by team",
    "KV-aware routing",
    "Adapters and MCP servers",
    "Batches",
}
ALERTS = {
    "FurnaceGatewayErrorRatio",
    "FurnaceGatewayTTFTAboveSLO",
    "FurnaceGatewayQueueWaitNearMax",
    "FurnaceGatewayNoHealthyWorker",
    "FurnaceGatewayNoPrefillWorker",
    "FurnaceGatewayWorkerFlapping",
    "FurnaceGatewayWorkerMisconfigured",
    "FurnaceGatewayLimitsStoreDown",
    "FurnaceGatewayAccountsStoreDown",
    "FurnaceGatewayBudgetNearlySpent",
    "FurnaceGatewayBudgetSpent",
    "FurnaceGatewayMcpServerFailing",
    "FurnaceGatewayBatchExpired",
}


def rendered() -> list[dict[str, Any]]:
    args = [
        tool("helm"),
        "template",
        "llm",
        str(CHART),
        "--set",
        "grafanaDashboard.enabled=true",
        "--set",
        "prometheusRule.enabled=true",
        "--set-json",
        'gateway.config.queue={"max_wait": 2}',
    ]
    return load_manifests(run(args).stdout)


def panel_exprs(dashboard: dict[str, Any]) -> list[str]:
    return [
        target["expr"]
        for panel in dashboard["panels"]
        if panel["type"] != "row"
        for target in panel["targets"]
    ]


def exported_names(text: str) -> set[str]:
    """The series names a scrape holds, with the suffixes of families that have no sample
    yet (a counter's `_total`, a histogram's `_bucket`, `_sum`, `_count`)."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(sample.name for sample in family.samples)
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names.update(family.name + suffix for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(family.name)
    return names


def test_the_chart_ships_the_repository_dashboard_and_the_alerts():
    dashboard = json.loads(DASHBOARD.read_text())
    assert (CHART / "dashboards" / "furnace-gateway.json").read_text() == DASHBOARD.read_text()
    manifests = rendered()
    configmap = one(manifests, "ConfigMap", "llm-furnace-gateway-dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads(configmap["data"]["furnace-gateway.json"])
    # the release names its copy: two releases' dashboards keep apart in one Grafana
    assert shipped.pop("title") == "Furnace gateway (default/llm-furnace-gateway)"
    assert shipped.pop("uid").startswith("furnace-gateway-")
    assert shipped == {k: v for k, v in dashboard.items() if k not in ("title", "uid")}
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "namespace", "job"}
    for expr in panel_exprs(dashboard):  # every series of a panel is the chosen gateways'
        for name in METRIC.findall(expr):
            assert f'{name}{{job=~"$job", namespace=~"$namespace"' in expr, expr
    assert {p["title"] for p in dashboard["panels"] if p["type"] == "row"} == ROWS
    rule = one(manifests, "PrometheusRule", "llm-furnace-gateway")
    alerts = {r["alert"] for group in rule["spec"]["groups"] for r in group["rules"]}
    assert alerts == ALERTS
    # off by default: neither is rendered
    default = load_manifests(run([tool("helm"), "template", "llm", str(CHART)]).stdout)
    assert not [m for m in default if m["kind"] == "PrometheusRule"]
    assert not [m for m in default if m["metadata"]["name"].endswith("-dashboard")]


def test_every_panel_and_alert_queries_metrics_the_gateway_exports(gateway_with, workers):
    key = new_key("search")
    config = make_config(workers)
    # the demo model routes on its worker's KV events, so the routing row's series exist
    models = tuple(
        replace(
            m,
            queue=QueueConfig(max_wait=5.0),
            routing=RoutingConfig() if m.name == "furnace-demo" else None,
        )
        for m in config.models
    )
    gw = gateway_with(
        **keyed({"search": {"tokens_per_minute": 100_000}}, {key: "search"}),
        models=models,
        queue=QueueConfig(max_wait=5.0),
        admin_port=0,
    )
    assert gw.admin_url is not None
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD, headers=bearer(key)) as client:
        body = {"model": "furnace-demo", "prompt": "a b c", "stream": True}
        assert client.post("/v1/completions", json=body).is_success
        assert client.post("/v1/completions", json={"prompt": "a b"}).is_success
    exported = exported_names(httpx.get(gw.admin_url + "/metrics", timeout=HANG_GUARD).text)

    exprs = panel_exprs(json.loads(DASHBOARD.read_text()))
    manifests = rendered()
    rule = one(manifests, "PrometheusRule", "llm-furnace-gateway")
    exprs += [str(r["expr"]) for group in rule["spec"]["groups"] for r in group["rules"]]
    assert exprs
    for expr in exprs:
        names = set(METRIC.findall(expr))
        assert names, f"no gateway metric in {expr!r}"
        assert names <= exported, f"{expr!r} queries {sorted(names - exported)}, not exported"
