"""The chart and the kustomize base hold the line by default, checked with the real helm and
kubectl and the Kubernetes schemas: only the API (/v1) is routed from outside, the workers'
gRPC ports take connections from the gateway's pods alone, a public route, a NodePort or
LoadBalancer Service or product teams without API keys refuse to render unless opted out, the
admin port is on a ClusterIP Service of its own, the image can be pinned by digest, every
emptyDir has a size limit, and the kustomize namespace enforces the restricted Pod Security
standard."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from tests.support.k8s_tools import (
    KUBERNETES_VERSIONS,
    ROOT,
    Manifest,
    load_manifests,
    of_kind,
    one,
    pod_specs,
    run,
    schema_problems,
    selects,
    tool,
)

CHART = ROOT / "helm" / "furnace-gateway"
KUSTOMIZE = ROOT / "deploy" / "kustomize" / "base"
RELEASE = "llm"
NAMESPACE = "inference"
FULLNAME = f"{RELEASE}-furnace-gateway"
ROUTES = ("--set", "ingress.enabled=true", "--set", "httpRoute.enabled=true")
OPT_OUT = ("--set", "gateway.allowUnauthenticated=true")
KEYS = ("--set", "gateway.keys.existingSecret=furnace-keys")
DIGEST = "sha256:" + "0123456789abcdef" * 4
FAIL_CLOSED = "exposes the gateway with no API keys"


def template(*args: str, check: bool = True) -> str:
    """`helm template` of the chart; with `check`, a failure fails the test."""
    command = [tool("helm"), "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args]
    result = run(command, check=check)
    return result.stdout if result.returncode == 0 else result.stderr


@functools.cache
def render(*args: str) -> tuple[Manifest, ...]:
    return tuple(load_manifests(template(*args)))


@functools.cache
def kustomize() -> tuple[Manifest, ...]:
    return tuple(load_manifests(run([tool("kubectl"), "kustomize", str(KUSTOMIZE)]).stdout))


def pod_labels(manifests: tuple[Manifest, ...], component: str) -> list[dict[str, str]]:
    return [
        m["spec"]["template"]["metadata"]["labels"]
        for m in of_kind(manifests, "Deployment", "StatefulSet")
        if m["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(
    "args",
    [(), (*ROUTES, *KEYS), (*ROUTES, *OPT_OUT, "--set", f"image.digest={DIGEST}")],
    ids=["default", "routes-with-keys", "routes-opted-out-digest"],
)
def test_the_renders_match_the_kubernetes_schemas(
    args: tuple[str, ...], version: str, tmp_path: Path
):
    assert schema_problems(list(render(*args)), version, tmp_path) == []


def test_by_default_only_the_gateway_reaches_the_workers_grpc_ports():
    manifests = render()
    policies = {p["metadata"]["name"]: p for p in of_kind(manifests, "NetworkPolicy")}
    (gateway_labels,) = pod_labels(manifests, "gateway")
    (worker_labels,) = pod_labels(manifests, "worker")
    worker = policies[f"{FULLNAME}-worker-demo"]["spec"]
    assert selects(worker["podSelector"]["matchLabels"], worker_labels)
    assert not selects(worker["podSelector"]["matchLabels"], gateway_labels)
    assert worker["policyTypes"] == ["Ingress"]
    (rule,) = worker["ingress"]
    assert rule["ports"] == [{"port": "grpc", "protocol": "TCP"}]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}  # pods of this namespace, no other
    assert selects(peer["podSelector"]["matchLabels"], gateway_labels)
    assert not selects(peer["podSelector"]["matchLabels"], worker_labels)
    gateway = policies[FULLNAME]["spec"]
    assert selects(gateway["podSelector"]["matchLabels"], gateway_labels)
    assert not selects(gateway["podSelector"]["matchLabels"], worker_labels)
    api, admin = gateway["ingress"]
    assert api == {"ports": [{"port": "http", "protocol": "TCP"}]}  # from anywhere
    # metrics and the fleet's workers: the release's namespace only
    assert admin == {"ports": [{"port": "admin", "protocol": "TCP"}], "from": [{"podSelector": {}}]}
    assert len(policies) == 2


def test_the_admin_port_takes_admin_from_only():
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mon"}}}
    manifests = render("--set-json", f"networkPolicy.adminFrom=[{json.dumps(monitoring)}]")
    _, admin = one(manifests, "NetworkPolicy", FULLNAME)["spec"]["ingress"]
    assert admin["from"] == [monitoring]
    closed = render("--set-json", "networkPolicy.adminFrom=[]")
    (api,) = one(closed, "NetworkPolicy", FULLNAME)["spec"]["ingress"]  # no pod reaches it
    assert api["ports"] == [{"port": "http", "protocol": "TCP"}]


def test_extra_peers_and_a_restricted_gateway_source():
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mon"}}}
    ingress_ns = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "edge"}}}
    manifests = render(
        "--set-json",
        f"networkPolicy.workerFrom=[{json.dumps(monitoring)}]",
        "--set-json",
        f"networkPolicy.gatewayFrom=[{json.dumps(ingress_ns)}]",
    )
    worker = one(manifests, "NetworkPolicy", f"{FULLNAME}-worker-demo")["spec"]
    assert worker["ingress"][0]["from"][1:] == [monitoring]
    gateway = one(manifests, "NetworkPolicy", FULLNAME)["spec"]
    peers = gateway["ingress"][0]["from"]
    assert peers[0] == ingress_ns
    (test_pod,) = of_kind(manifests, "Pod")  # helm test still reaches the Service
    assert selects(peers[1]["podSelector"]["matchLabels"], test_pod["metadata"]["labels"])


def test_network_policies_can_be_turned_off():
    assert not list(of_kind(render("--set", "networkPolicy.enabled=false"), "NetworkPolicy"))


def test_the_ingress_and_route_expose_only_the_api():
    manifests = render(*ROUTES, *KEYS)
    ingress = one(manifests, "Ingress", FULLNAME)
    paths = [p for rule in ingress["spec"]["rules"] for p in rule["http"]["paths"]]
    assert [(p["path"], p["pathType"]) for p in paths] == [("/v1", "Prefix")]
    (rule,) = one(manifests, "HTTPRoute", FULLNAME)["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    # /metrics stays in the cluster: the ServiceMonitor scrapes the Service's admin port
    monitored = render(*ROUTES, *KEYS, "--set", "serviceMonitor.enabled=true")
    (endpoint,) = one(monitored, "ServiceMonitor", FULLNAME)["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["port"] == "admin"


def test_the_exposed_prefixes_are_a_value():
    manifests = render(*ROUTES, *KEYS, "--set-json", 'exposedPathPrefixes=["/v1", "/v2"]')
    ingress = one(manifests, "Ingress", FULLNAME)
    assert [p["path"] for p in ingress["spec"]["rules"][0]["http"]["paths"]] == ["/v1", "/v2"]
    (rule,) = one(manifests, "HTTPRoute", FULLNAME)["spec"]["rules"]
    assert [m["path"]["value"] for m in rule["matches"]] == ["/v1", "/v2"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--set", "ingress.enabled=true"), FAIL_CLOSED),
        (("--set", "httpRoute.enabled=true"), FAIL_CLOSED),
        (("--set-json", 'gateway.teams={"search": {}}'), "gateway.teams is set with no API keys"),
        (("--set", "service.type=LoadBalancer"), "service.type=LoadBalancer " + FAIL_CLOSED),
        (("--set", "service.type=NodePort"), "service.type=NodePort " + FAIL_CLOSED),
    ],
)
def test_public_routes_or_teams_without_keys_fail_to_render(args: tuple[str, ...], message: str):
    result = run([tool("helm"), "template", RELEASE, str(CHART), *args], check=False)
    assert result.returncode != 0
    assert message in result.stderr
    assert "gateway.allowUnauthenticated=true" in result.stderr


@pytest.mark.parametrize("service_type", ["LoadBalancer", "NodePort"])
def test_an_outside_service_with_keys_carries_the_api_only(service_type: str):
    for args in (KEYS, OPT_OUT):
        manifests = render("--set", f"service.type={service_type}", *args)
        service = one(manifests, "Service", FULLNAME)["spec"]
        assert service["type"] == service_type
        assert [p["name"] for p in service["ports"]] == ["http"]
        admin = one(manifests, "Service", f"{FULLNAME}-admin")["spec"]
        assert admin["type"] == "ClusterIP"
        assert [(p["name"], p["targetPort"]) for p in admin["ports"]] == [("admin", "admin")]
        assert admin["selector"] == service["selector"]


def test_the_service_monitor_selects_the_admin_service_alone():
    manifests = render("--set", "serviceMonitor.enabled=true")
    selector = one(manifests, "ServiceMonitor", FULLNAME)["spec"]["selector"]["matchLabels"]
    admin = one(manifests, "Service", f"{FULLNAME}-admin")["metadata"]["labels"]
    api = one(manifests, "Service", FULLNAME)["metadata"]["labels"]
    assert selects(selector, admin)
    assert not selects(selector, api)


def test_the_opt_out_renders_public_routes_without_keys():
    kinds = {m["kind"] for m in render(*ROUTES, *OPT_OUT)}
    assert {"Ingress", "HTTPRoute"} <= kinds
    teams = render("--set-json", 'gateway.teams={"search": {}}', *OPT_OUT)
    assert one(teams, "ConfigMap", FULLNAME)


def test_a_digest_pins_the_chart_image_and_a_pool_keeps_its_own():
    pool_image = '{"repository": "registry.example.com/engine", "tag": "1.0"}'
    manifests = render(
        "--set", f"image.digest={DIGEST}", "--set-json", f"workerPools.demo.image={pool_image}"
    )
    images = {name: [c["image"] for c in spec["containers"]] for name, spec in pod_specs(manifests)}
    assert images[f"Deployment/{FULLNAME}"] == [f"furnace-gateway@{DIGEST}"]
    assert images[f"Deployment/{FULLNAME}-worker-demo"] == ["registry.example.com/engine:1.0"]
    test_pod = next(v for k, v in images.items() if k.startswith("Pod/"))
    assert test_pod == [f"furnace-gateway@{DIGEST}"]


def test_the_schema_refuses_a_malformed_digest():
    result = run(
        [tool("helm"), "template", RELEASE, str(CHART), "--set", "image.digest=latest"],
        check=False,
    )
    assert result.returncode != 0 and "schema" in result.stderr


@pytest.mark.parametrize(
    "args",
    [(), ("--values", str(CHART / "ci" / "gpu-fleet-values.yaml"))],
    ids=["default", "gpu-fleet"],
)
def test_every_emptydir_has_a_size_limit(args: tuple[str, ...]):
    volumes = [
        (name, volume)
        for name, spec in pod_specs(render(*args))
        for volume in spec.get("volumes", [])
        if "emptyDir" in volume
    ]
    assert volumes
    for name, volume in volumes:
        assert volume["emptyDir"].get("sizeLimit"), f"{name}: {volume['name']}"
    tmp = [v["emptyDir"]["sizeLimit"] for _, v in volumes if v["name"] == "tmp"]
    assert set(tmp) == {"64Mi"}


def test_a_pool_sets_its_own_tmp_size_limit():
    manifests = render("--set", "workerPools.demo.tmpSizeLimit=2Gi")
    spec = one(manifests, "Deployment", f"{FULLNAME}-worker-demo")["spec"]["template"]["spec"]
    (tmp,) = [v for v in spec["volumes"] if v["name"] == "tmp"]
    assert tmp["emptyDir"]["sizeLimit"] == "2Gi"


def test_the_kustomize_namespace_enforces_the_restricted_pod_security_standard():
    manifests = kustomize()
    labels = one(manifests, "Namespace", "furnace")["metadata"]["labels"]
    for mode in ("enforce", "audit", "warn"):
        assert labels[f"pod-security.kubernetes.io/{mode}"] == "restricted"
    for name, spec in pod_specs(manifests):
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        for volume in spec.get("volumes", []):
            if "emptyDir" in volume:
                assert volume["emptyDir"].get("sizeLimit"), f"{name}: {volume['name']}"
