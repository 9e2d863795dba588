"""The Helm chart, checked with the real helm: lint, render with the default values and a
GPU fleet's, validate every object against the Kubernetes schemas, and read the rendered
objects: the gateway's own loader accepts the config, every pool has the headless Service
the config points at, the probes hit real routes, the grace period covers pause and drain
(a worker's drain fits its pod's), the schema refuses wrong types, a config change rolls
the pods, and the product teams' keys, Redis URL and TLS files come from Secrets, never the
ConfigMap."""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from starlette.routing import Route

from gateway import lifecycle
from gateway.cli import _parser
from gateway.config import Config, load_config, parse_config
from tests.support.k8s_tools import (
    KUBERNETES_VERSIONS,
    ROOT,
    Manifest,
    check_restricted,
    check_worker_pools,
    load_manifests,
    of_kind,
    one,
    prestop_sleep,
    run,
    schema_problems,
    selects,
    tool,
)
from tests.support.servers import Gateway

CHART = ROOT / "helm" / "furnace-gateway"
GPU_FLEET = CHART / "ci" / "gpu-fleet-values.yaml"
TEAMS = CHART / "ci" / "teams-values.yaml"
NAMESPACE = "inference"
RELEASE = "llm"
FULLNAME = f"{RELEASE}-furnace-gateway"
VALUES = {
    "default": (),
    "gpu-fleet": ("--values", str(GPU_FLEET)),
    "teams": ("--values", str(TEAMS)),
}
REDIS_URL = "rediss://:s3cret-password@redis.furnace.svc:6380/0"


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Runs the installed helm."""
    return run([tool("helm"), *args], check=check)


@functools.cache
def render(*args: str) -> tuple[Manifest, ...]:
    """The chart's objects as `helm template` renders them with these arguments."""
    output = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args).stdout
    return tuple(load_manifests(output))


def values(*args: str) -> dict[str, Any]:
    """The chart's values merged with the values files among `args` (one level deep is
    enough for what the tests read)."""
    merged = yaml.safe_load((CHART / "values.yaml").read_text())
    files = [args[i + 1] for i, arg in enumerate(args) if arg == "--values"]
    for path in files:
        for key, value in yaml.safe_load(Path(path).read_text()).items():
            if isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **value}
            else:
                merged[key] = value
    return merged


def gateway_config(manifests: tuple[Manifest, ...]) -> dict[str, Any]:
    """The gateway's config file as the chart renders it, as YAML data."""
    configmap = one(manifests, "ConfigMap", FULLNAME)
    return yaml.safe_load(configmap["data"]["config.yaml"])


def with_mounted_files(raw: dict[str, Any], root: Path) -> dict[str, Any]:
    """The rendered config with the files its pod mounts from Secrets (the keys file, the
    worker TLS files) made under `root` and the paths moved there: what the gateway reads at
    start. The keys file holds one key of the first team."""
    raw = copy.deepcopy(raw)

    def place(path: str, text: str) -> str:
        local = root / path.lstrip("/")
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_text(text)
        return str(local)

    if "keys_file" in raw:
        key = {"sha256": hashlib.sha256(b"sk-test").hexdigest(), "team": next(iter(raw["teams"]))}
        raw["keys_file"] = place(raw["keys_file"], yaml.safe_dump([key]))
    tls = raw.get("worker_tls") or {}
    for name in ("ca_file", "cert_file", "key_file"):
        if name in tls:
            tls[name] = place(tls[name], "-----BEGIN PLACEHOLDER-----\n")
    return raw


def loaded_config(
    manifests: tuple[Manifest, ...], root: Path, env: dict[str, str] | None = None
) -> Config:
    """The rendered config as the gateway's loader reads it in the pod."""
    return parse_config(with_mounted_files(gateway_config(manifests), root), env=env or {})


def secret_behind(spec: Manifest, container: Manifest, path: str) -> tuple[str, str]:
    """The Secret and its key that a file of a container comes from, through a read-only
    mount of a secret volume."""
    for mount in container["volumeMounts"]:
        folder = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(folder):
            assert mount.get("readOnly") is True, mount
            (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
            items = volume["secret"]["items"]
            (key,) = [i["key"] for i in items if i["path"] == path[len(folder) :]]
            return volume["secret"]["secretName"], key
    raise AssertionError(f"{path} is on no mount of {container['name']}")


def gateway_pod(manifests: tuple[Manifest, ...]) -> Manifest:
    """The gateway Deployment's pod template."""
    return one(manifests, "Deployment", FULLNAME)["spec"]["template"]


def checksum(*args: str) -> str:
    """The config checksum annotation of the gateway's pods."""
    return gateway_pod(render(*args))["metadata"]["annotations"]["checksum/config"]


@pytest.mark.parametrize("name", VALUES)
def test_lint_strict(name: str):
    result = helm("lint", "--strict", str(CHART), *VALUES[name])
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("name", VALUES)
def test_manifests_match_the_kubernetes_schemas(name: str, version: str, tmp_path: Path):
    manifests = list(render(*VALUES[name]))
    assert schema_problems(manifests, version, tmp_path) == []


def test_the_gpu_fleet_renders_every_optional_object():
    kinds = {m["kind"] for m in render(*VALUES["gpu-fleet"])}
    assert {"Ingress", "HTTPRoute", "ServiceMonitor", "StatefulSet"} <= kinds
    assert {"HorizontalPodAutoscaler", "PodDisruptionBudget", "ConfigMap"} <= kinds


@pytest.mark.parametrize("name", VALUES)
def test_the_gateway_loader_accepts_the_rendered_config(name: str, tmp_path: Path):
    raw = with_mounted_files(gateway_config(render(*VALUES[name])), tmp_path)
    config = parse_config(raw, env={})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert load_config(path, env={}) == config
    assert [m.name for m in config.models] == [m["name"] for m in values(*VALUES[name])["models"]]
    assert config.drain_timeout == values(*VALUES[name])["gateway"]["drainTimeout"]


@pytest.mark.parametrize("name", VALUES)
def test_every_pool_has_the_headless_service_the_config_points_at(name: str):
    manifests = list(render(*VALUES[name]))
    addresses = check_worker_pools(manifests, NAMESPACE)
    models = gateway_config(render(*VALUES[name]))["models"]
    configured = {w for m in models for w in m.get("workers", [])}
    assert addresses
    assert addresses == {w for w in configured if w.startswith("dns:///")}


def test_models_reach_their_own_pools_and_outside_workers():
    models = {m["name"]: m for m in gateway_config(render(*VALUES["gpu-fleet"]))["models"]}
    pool = f"dns:///{FULLNAME}-worker-qwen-2-72b.{NAMESPACE}.svc.cluster.local:50052"
    assert models["qwen-2-72b"]["workers"] == [pool, "10.20.0.7:50051", "10.20.0.8:50051"]
    assert models["qwen-2-72b"]["routing"] == {"policy": "kv_aware"}  # issue 26's contract
    assert models["llama-3-8b"]["max_model_len"] == 8192
    assert models["llama-3-8b"]["balance"] == "prefix_affinity"
    assert models["resnet-50"]["kind"] == "tensor"
    assert "demo" not in str(models)


def test_a_reranker_reaches_the_gateway_as_a_cross_encoder():
    reranker = {
        "name": "bge-reranker",
        "upstream": "openai",
        "workers": ["http://bge-reranker:8000/v1"],
        "scoring": "cross-encoder",
    }
    config = gateway_config(render("--set-json", f"models={json.dumps([reranker])}"))
    assert config["models"][0]["scoring"] == "cross-encoder"
    assert parse_config(config, env={}).models[0].scoring == "cross-encoder"


def test_a_disaggregated_model_reaches_the_gateway_with_its_prefill_workers():
    model = {
        "name": "llama",
        "upstream": "openai",
        "workers": ["http://llama-decode:8000/v1"],
        "prefillWorkers": ["http://llama-prefill:8000/v1"],
    }
    config = gateway_config(render("--set-json", f"models={json.dumps([model])}"))
    assert config["models"][0]["prefill_workers"] == ["http://llama-prefill:8000/v1"]
    parsed = parse_config(config, env={}).models[0]
    assert parsed.prefill_workers == ("http://llama-prefill:8000/v1",)


@pytest.mark.parametrize("name", VALUES)
def test_probes_point_at_real_routes_of_the_gateway(name: str, tmp_path: Path):
    manifests = render(*VALUES[name])
    config: Config = loaded_config(manifests, tmp_path)
    routes = {
        route.path: route.methods or set()
        for route in lifecycle.Gateway(config).app.routes
        if isinstance(route, Route)
    }
    container = gateway_pod(manifests)["spec"]["containers"][0]
    http, admin = container["ports"]
    assert http == {"name": "http", "containerPort": config.port, "protocol": "TCP"}
    assert admin == {"name": "admin", "containerPort": config.admin_port, "protocol": "TCP"}
    liveness = container["livenessProbe"]["httpGet"]
    readiness = container["readinessProbe"]["httpGet"]
    assert liveness == {"path": "/health", "port": "http"}  # alive: never asks the workers
    assert readiness == {"path": "/ready", "port": "http"}
    for probe in (liveness, readiness):
        assert "GET" in routes[probe["path"]]


@pytest.mark.parametrize("name", VALUES)
def test_the_grace_period_outlasts_the_pause_and_the_drain(name: str):
    pod = gateway_pod(render(*VALUES[name]))["spec"]
    drain = values(*VALUES[name])["gateway"]["drainTimeout"]
    pause = prestop_sleep(pod["containers"][0])
    assert pod["terminationGracePeriodSeconds"] > pause + drain


def test_the_grace_period_follows_the_drain_timeout():
    manifests = render("--set", "gateway.drainTimeout=300")
    pod = gateway_pod(manifests)["spec"]
    assert parse_config(gateway_config(manifests), env={}).drain_timeout == 300
    assert pod["terminationGracePeriodSeconds"] > prestop_sleep(pod["containers"][0]) + 300


def _demo_pool(*args: str) -> tuple[int, list[str]]:
    """The demo pool's grace period and its worker's args, rendered with `args`."""
    workload = one(render(*args), "Deployment", f"{FULLNAME}-worker-demo")
    spec = workload["spec"]["template"]["spec"]
    return spec["terminationGracePeriodSeconds"], spec["containers"][0]["args"]


def test_a_worker_drains_for_its_pods_grace_period():
    """A stopping worker lets answers in flight finish for its pod's grace period less
    5 s (for the engine's shutdown before the kubelet's SIGKILL), not a fixed 5 s: the
    chart passes `--drain-timeout` to our worker, keeps one its args pass, and gives
    other images' args none."""
    grace, args = _demo_pool()
    assert (grace, args[args.index("--drain-timeout") + 1]) == (30, "25")
    parsed, _ = _parser().parse_known_args(args[1:])  # as the worker reads it
    assert parsed.drain_timeout == 25.0

    grace, args = _demo_pool("--set", "workerPools.demo.terminationGracePeriodSeconds=300")
    assert (grace, args[args.index("--drain-timeout") + 1]) == (300, "295")

    own = '["furnace-gateway", "worker", "--drain-timeout", "7"]'
    _, args = _demo_pool("--set-json", f"workerPools.demo.args={own}")
    assert args == ["furnace-gateway", "worker", "--drain-timeout", "7"]

    triton = '["tritonserver", "--model-repository=/models"]'
    _, args = _demo_pool("--set-json", f"workerPools.demo.args={triton}")
    assert args == ["tritonserver", "--model-repository=/models"]


@pytest.mark.parametrize(
    "args",
    [
        ("--set", "gateway.replicaCount=two"),
        ("--set", "gateway.drainTimeout=soon"),
        ("--set-string", "gateway.config.max_concurrent_requests=64"),
        ("--set", "gateway.config.log_level=loud"),
        ("--set", "gateway.config.drain_timeout=30"),  # gateway.drainTimeout sets it
        ("--set", "gateway.config.no_such_field=1"),
        ("--set", "gateway.config.discovery_interval=often"),
        ("--set", "workerPools.demo.gpu.count=one"),
        ("--set", "workerPools.demo.kind=DaemonSet"),
        ("--set-json", 'models=[{"name": "furnace-demo", "kind": "vision", "pools": ["demo"]}]'),
        ("--set", "autoscaling.enabled=yes"),
        ("--set", "gateway.teams.search.requests_per_minute=many"),
        ("--set", "gateway.teams.search.budget=1"),
        ("--set", "gateway.keys.existingSecret=true"),
        ("--set", "gateway.redis.url=http://redis:6379"),
        ("--set", "gateway.allowLocalLimits=yes"),
        ("--set", "workerPools.demo.tls.verifyClients=yes"),
        ("--set-json", 'models=[{"name": "m", "upstream": "http", "workers": ["x:1"]}]'),
        ("--set-json", 'models=[{"name": "m", "pools": ["demo"], "maxTokensLimit": "lots"}]'),
    ],
)
def test_the_values_schema_refuses_wrong_values(args: tuple[str, str]):
    result = helm("template", RELEASE, str(CHART), *args, check=False)
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr


def test_a_model_naming_a_missing_pool_fails_to_render():
    models = '[{"name": "furnace-demo", "pools": ["gone"]}]'
    result = helm("template", RELEASE, str(CHART), "--set-json", f"models={models}", check=False)
    assert result.returncode != 0
    assert 'models[0].pools: "gone" is not a key of workerPools' in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("--set-json", 'models=[{"name": "m", "upstream": "openai", "pools": ["demo"]}]'),
            "an openai upstream takes base URLs in workers, not pools",
        ),
        (
            ("--set-json", 'models=[{"name": "m", "pools": ["demo"], "scoring": "cross-encoder"}]'),
            "models[0].scoring: cross-encoder only for upstream openai",
        ),
        (
            (
                "--set-json",
                'models=[{"name": "m", "pools": ["demo"], "prefillWorkers": ["http://p/v1"]}]',
            ),
            "models[0].prefillWorkers: only for upstream openai or vllm-grpc",
        ),
        (
            ("--set-json", 'models=[{"name": "m", "pools": ["demo"], "weights": {"x:1": 2}}]'),
            'models[0].weights: "x:1" is not one of the model\'s workers',
        ),
        (
            ("--set-json", 'gateway.teams={"search": {"models": ["gone"]}}'),
            'gateway.teams.search.models[0]: "gone" is not a model of models',
        ),
    ],
)
def test_team_and_model_mistakes_fail_to_render(args: tuple[str, str], message: str):
    result = helm("template", RELEASE, str(CHART), *args, check=False)
    assert result.returncode != 0
    assert message in result.stderr


@pytest.mark.parametrize(
    "teams",
    [
        'gateway.teams={"search": {"tokens_per_minute": 1000}}',
        'gateway.teams={"ads": {"budgets": [{"window": "day", "tokens": 5000}]}}',
    ],
)
def test_teams_limits_without_redis_on_several_pods_fail_to_render(teams: str):
    """Without Redis each gateway pod enforces a team's limits in full (two pods let it
    through twice) and a restart forgets its budgets: with several pods the chart refuses,
    unless Redis shares them or `gateway.allowLocalLimits` keeps them per pod."""
    args = ("--set", "gateway.keys.existingSecret=furnace-keys", "--set-json", teams)
    no_hpa = ("--set", "autoscaling.enabled=false")
    for pods in ((), (*no_hpa, "--set", "gateway.replicaCount=2")):  # the autoscaler, or 2
        result = helm("template", RELEASE, str(CHART), *args, *pods, check=False)
        assert result.returncode != 0
        assert "without Redis on more than one gateway pod" in result.stderr
        assert "gateway.allowLocalLimits=true" in result.stderr
    assert gateway_pod(render(*args, *no_hpa, "--set", "gateway.replicaCount=1"))
    assert gateway_pod(render(*args, "--set", "gateway.redis.existingSecret=furnace-redis"))
    assert gateway_pod(render(*args, "--set", "gateway.allowLocalLimits=true"))
    free = 'gateway.teams={"free": {"weight": 2}}'  # no limit to share
    assert gateway_pod(render(*args[:2], "--set-json", free))


def test_the_config_checksum_rolls_the_pods_on_a_config_change():
    base = checksum()
    shown = helm(
        "template",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--show-only",
        "templates/configmap.yaml",
    ).stdout
    configmap = shown.split("\n", 2)[2]  # after "---" and "# Source: ..."
    assert base == hashlib.sha256(configmap.encode()).hexdigest()  # the ConfigMap's own hash
    assert checksum("--set", "gateway.config.max_concurrent_requests=64") != base
    assert checksum("--set", "workerPools.demo.port=50052") != base
    models = '[{"name": "furnace-demo", "pools": ["demo"], "maxModelLen": 2048}]'
    assert checksum("--set-json", f"models={models}") != base
    assert checksum("--set", "service.port=8080") == base  # not in the config


def test_every_pod_is_restricted():
    check_restricted(list(render()))


def test_gpu_pools_get_gpus_nodes_and_tolerations():
    manifests = list(render(*VALUES["gpu-fleet"]))
    llama = one(manifests, "StatefulSet", f"{FULLNAME}-worker-llama-3-8b")
    qwen = one(manifests, "Deployment", f"{FULLNAME}-worker-qwen-2-72b")
    for workload, gpus in ((llama, 1), (qwen, 4)):
        spec = workload["spec"]["template"]["spec"]
        assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
        assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
        assert {"name": "shm", "mountPath": "/dev/shm"} in spec["containers"][0]["volumeMounts"]
    assert llama["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"] == {
        "storage": "200Gi"
    }
    assert qwen["spec"]["template"]["spec"]["containers"][0]["command"][0] == "/usr/bin/tini"


def test_worker_probes_use_the_grpc_health_service():
    (worker,) = (
        d for d in of_kind(render(), "Deployment") if d["metadata"]["name"].endswith("-worker-demo")
    )
    container = worker["spec"]["template"]["spec"]["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": 50051}
    args = container["args"]
    assert args[args.index("--port") + 1] == "50051"


def test_autoscaler_and_disruption_budget_target_the_gateway():
    manifests = list(render(*VALUES["gpu-fleet"]))
    hpa = one(manifests, "HorizontalPodAutoscaler", FULLNAME)
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": FULLNAME,
    }
    metrics = {m["type"]: m for m in hpa["spec"]["metrics"]}
    assert metrics["Resource"]["resource"]["name"] == "cpu"
    assert metrics["Pods"]["pods"]["metric"]["name"] == "furnace_gateway_inflight_requests"
    assert "replicas" not in one(manifests, "Deployment", FULLNAME)["spec"]  # the HPA's
    pdb = one(manifests, "PodDisruptionBudget", FULLNAME)
    pod_labels = gateway_pod(render())["metadata"]["labels"]
    assert selects(pdb["spec"]["selector"]["matchLabels"], pod_labels)
    fixed = one(render("--set", "autoscaling.enabled=false"), "Deployment", FULLNAME)
    assert fixed["spec"]["replicas"] == 2


def test_the_autoscaler_metric_and_the_monitor_path_are_served(gateway: Gateway):
    manifests = list(render(*VALUES["gpu-fleet"]))
    hpa = one(manifests, "HorizontalPodAutoscaler", FULLNAME)
    (pods,) = [m["pods"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    (endpoint,) = one(manifests, "ServiceMonitor", FULLNAME)["spec"]["endpoints"]
    exposition = httpx.get(gateway.url + endpoint["path"], timeout=10)
    assert exposition.status_code == 200
    assert f"# TYPE {pods['metric']['name']} gauge" in exposition.text


def test_ingress_route_and_monitor_reach_the_gateway_service():
    manifests = list(render(*VALUES["gpu-fleet"]))
    service = one(manifests, "Service", FULLNAME)
    (port,) = service["spec"]["ports"]
    admin_service = one(manifests, "Service", f"{FULLNAME}-admin")
    (admin,) = admin_service["spec"]["ports"]
    assert (port["name"], admin["name"], admin["targetPort"]) == ("http", "admin", "admin")
    assert selects(service["spec"]["selector"], gateway_pod(tuple(manifests))["metadata"]["labels"])
    ingress = one(manifests, "Ingress", FULLNAME)
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": FULLNAME, "port": {"name": port["name"]}}
    route = one(manifests, "HTTPRoute", FULLNAME)
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"][0]["name"] == "public"
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"name": FULLNAME, "port": port["port"]}]
    monitor = one(manifests, "ServiceMonitor", FULLNAME)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    labels = admin_service["metadata"]["labels"]
    assert selects(monitor["spec"]["selector"]["matchLabels"], labels)
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == admin["name"] and endpoint["path"] == "/metrics"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}


def test_notes_give_the_first_request():
    result = helm("install", "--dry-run=client", RELEASE, str(CHART), "--namespace", NAMESPACE)
    notes = result.stdout.split("NOTES:", 1)[1]
    assert f"port-forward service/{FULLNAME} 8000:80" in notes
    assert "curl -s http://127.0.0.1:8000/v1/chat/completions" in notes
    assert '"model": "furnace-demo"' in notes
    assert f"helm test {RELEASE}" in notes


def _helm_test_pod() -> tuple[str, dict[str, str]]:
    (pod,) = of_kind(render(), "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (container,) = pod["spec"]["containers"]
    assert container["args"][:2] == ["python", "-c"]
    env = {e["name"]: e["value"] for e in container["env"]}
    return container["args"][2], env


def _run_helm_test(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script],
        env={"PATH": os.environ.get("PATH", ""), **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_the_helm_test_pod_sends_a_chat_completion_through_the_service(gateway: Gateway):
    script, env = _helm_test_pod()
    assert env["FURNACE_URL"] == f"http://{FULLNAME}:80"  # the gateway's Service
    assert env["FURNACE_MODEL"] == "furnace-demo"
    # The same script, against a real gateway and demo worker on loopback.
    result = _run_helm_test(script, {**env, "FURNACE_URL": gateway.url})
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == "OK"
    assert '"hello from the fleet"' in result.stdout


def test_the_helm_test_pod_fails_on_a_wrong_answer(gateway: Gateway):
    script, env = _helm_test_pod()
    result = _run_helm_test(
        script, {**env, "FURNACE_URL": gateway.url, "FURNACE_MODEL": "resnet-50"}
    )
    assert result.returncode != 0
    assert "FAIL" in result.stderr and "model_not_supported" in result.stderr


def test_teams_keys_redis_and_tls_reach_the_gateway(tmp_path: Path):
    manifests = render(*VALUES["teams"])
    assert "redis_url" not in gateway_config(manifests)  # only in the pod's environment
    config = loaded_config(manifests, tmp_path, env={"FURNACE_REDIS_URL": REDIS_URL})
    assert config.redis_url == REDIS_URL
    assert (config.redis_timeout, config.redis_key_prefix) == (0.5, "furnace-prod")
    teams = {t.name: t for t in config.teams}
    assert teams["search"].weight == 3 and teams["search"].requests_per_minute == 600
    assert teams["search"].models == ("furnace-demo",)
    assert teams["batch-eval"].tokens_per_minute == 50000
    assert config.keys_file is not None
    assert config.worker_tls is not None
    assert config.worker_tls.server_name == "worker.furnace.internal"
    models = {m.name: m for m in config.models}
    assert models["furnace-demo"].max_tokens_limit == 1024
    hosted = models["hosted-llm"]
    assert hosted.upstream == "openai" and hosted.weights == (("http://10.30.0.5:8000/v1", 2.0),)


def test_keys_and_worker_tls_are_read_only_secret_mounts_the_config_points_at():
    manifests = render(*VALUES["teams"])
    raw = gateway_config(manifests)
    spec = gateway_pod(manifests)["spec"]
    (container,) = spec["containers"]
    assert secret_behind(spec, container, raw["keys_file"]) == ("furnace-keys", "keys.yaml")
    tls = raw["worker_tls"]
    for field, key in (("ca_file", "ca.crt"), ("cert_file", "tls.crt"), ("key_file", "tls.key")):
        assert secret_behind(spec, container, tls[field]) == ("furnace-gateway-tls", key)


def test_a_tls_worker_pool_serves_its_secret_and_is_probed_on_its_port():
    manifests = render(*VALUES["teams"])
    pool = one(manifests, "Deployment", f"{FULLNAME}-worker-demo")["spec"]["template"]["spec"]
    (container,) = pool["containers"]
    args = container["args"]
    for flag, key in (
        ("--tls-cert", "tls.crt"),
        ("--tls-key", "tls.key"),
        ("--tls-client-ca", "ca.crt"),
    ):
        assert secret_behind(pool, container, args[args.index(flag) + 1]) == (
            "furnace-worker-tls",
            key,
        )
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["tcpSocket"] == {"port": 50051}  # the kubelet speaks no TLS


def redis_env(manifests: tuple[Manifest, ...]) -> Manifest:
    """The gateway container's FURNACE_REDIS_URL variable."""
    env = gateway_pod(manifests)["spec"]["containers"][0]["env"]
    (variable,) = [e for e in env if e["name"] == "FURNACE_REDIS_URL"]
    assert set(variable) == {"name", "valueFrom"}  # never a literal value
    return variable


def test_the_redis_url_reaches_the_gateway_only_from_a_secret(tmp_path: Path):
    reference = redis_env(render(*VALUES["teams"]))["valueFrom"]
    assert reference == {"secretKeyRef": {"name": "furnace-redis", "key": "url"}}
    manifests = render("--set", f"gateway.redis.url={REDIS_URL}")
    (secret,) = of_kind(manifests, "Secret")
    holding = [m for m in manifests if REDIS_URL in yaml.safe_dump(m)]
    assert holding == [secret]  # not the ConfigMap, not the Deployment
    name = secret["metadata"]["name"]
    assert secret["stringData"] == {"redis-url": REDIS_URL}
    ref = {"secretKeyRef": {"name": name, "key": "redis-url"}}
    assert redis_env(manifests)["valueFrom"] == ref
    assert "checksum/redis" in gateway_pod(manifests)["metadata"]["annotations"]
    assert schema_problems(list(manifests), KUBERNETES_VERSIONS[-1], tmp_path) == []
    both = ("--set", f"gateway.redis.url={REDIS_URL}", "--set", "gateway.redis.existingSecret=r")
    result = helm("template", RELEASE, str(CHART), *both, check=False)
    assert result.returncode != 0 and "set url or existingSecret, not both" in result.stderr
    assert "FURNACE_REDIS_URL" not in str(gateway_pod(render())["spec"])  # off by default
