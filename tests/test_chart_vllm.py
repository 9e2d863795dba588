"""The chart with a pool of stock vLLM gRPC servers next to a pool of our workers, with
the real helm: it lints and validates against the Kubernetes schemas, the vLLM pool runs
`python3 -m vllm.entrypoints.grpc_server` on its port with its GPUs and gRPC health
probes, its model reaches it with `upstream: vllm-grpc` and the tokenizer files mounted
from a ConfigMap or a volume, the gateway's loader takes the rendered config, and the
mistakes (no model, no image, TLS, no tokenizer, mixed engines) fail to render."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import parse_config
from tests.support.k8s_tools import (
    KUBERNETES_VERSIONS,
    ROOT,
    Manifest,
    check_restricted,
    check_worker_pools,
    load_manifests,
    one,
    run,
    schema_problems,
    tool,
)
from tests.support.tiny_model import build_tiny_model

CHART = ROOT / "helm" / "furnace-gateway"
NAMESPACE = "inference"
RELEASE = "llm"
FULLNAME = f"{RELEASE}-furnace-gateway"
POOL = f"{FULLNAME}-worker-llama"
MODEL = "llama-3-8b"
VALUES: dict[str, Any] = {
    "models": [
        {"name": "furnace-demo", "pools": ["demo"]},
        {"name": MODEL, "pools": ["llama"], "tokenizer": {"configMap": "llama-tokenizer"}},
    ],
    "workerPools": {
        "llama": {
            "engine": "vllm-grpc",
            "image": {"repository": "registry.example.com/vllm-grpc", "tag": "v0.32.0"},
            "vllm": {"model": "meta-llama/Meta-Llama-3-8B-Instruct"},
            "args": ["--max-model-len", "8192"],
            "port": 50061,
            "gpu": {"count": 1},
            "shmSize": "8Gi",
        }
    },
}


def render(values: dict[str, Any], tmp_path: Path, check: bool = True) -> Any:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    args = [tool("helm"), "template", RELEASE, str(CHART), "-n", NAMESPACE, "-f", str(path)]
    result = run(args, check=check)
    return load_manifests(result.stdout) if check else result


def changed(**edits: Any) -> dict[str, Any]:
    """VALUES with `pool` or `model` fields replaced (None: removed)."""
    values = copy.deepcopy(VALUES)
    targets = {"pool": values["workerPools"]["llama"], "model": values["models"][1]}
    for where, fields in edits.items():
        for key, value in fields.items():
            if value is None:
                targets[where].pop(key, None)
            else:
                targets[where][key] = value
    return values


def gateway_pod(manifests: list[Manifest]) -> Manifest:
    return one(manifests, "Deployment", FULLNAME)["spec"]["template"]["spec"]


def test_lints_strict(tmp_path: Path):
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(VALUES))
    result = run([tool("helm"), "lint", "--strict", str(CHART), "-f", str(path)])
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_matches_the_kubernetes_schemas(version: str, tmp_path: Path):
    manifests = render(VALUES, tmp_path)
    assert schema_problems(manifests, version, tmp_path) == []
    check_restricted(manifests)


def test_the_vllm_pool_runs_the_grpc_server_with_its_gpus(tmp_path: Path):
    workload = one(render(VALUES, tmp_path), "Deployment", POOL)
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "registry.example.com/vllm-grpc:v0.32.0"
    assert container["command"] == ["python3", "-m", "vllm.entrypoints.grpc_server"]
    assert container["args"] == [
        "--model", "meta-llama/Meta-Llama-3-8B-Instruct", "--host", "0.0.0.0",
        "--port", "50061", "--max-model-len", "8192",
    ]  # fmt: skip
    assert container["ports"] == [{"name": "grpc", "containerPort": 50061, "protocol": "TCP"}]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    # vLLM's gRPC server serves grpc.health.v1: the kubelet's gRPC probes
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": 50061}
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["HF_HOME"].startswith("/tmp/")  # a writable home on a read-only root


def test_the_model_reaches_the_pool_with_vllm_grpc_and_its_tokenizer(tmp_path: Path):
    manifests = render(VALUES, tmp_path)
    config = yaml.safe_load(one(manifests, "ConfigMap", FULLNAME)["data"]["config.yaml"])
    demo, llama = config["models"]
    assert "upstream" not in demo and "tokenizer" not in demo
    assert llama["upstream"] == "vllm-grpc"
    assert llama["tokenizer"] == f"/etc/furnace-tokenizers/{MODEL}"
    addresses = check_worker_pools(manifests, NAMESPACE)
    assert set(llama["workers"]) | set(demo["workers"]) == addresses
    spec = gateway_pod(manifests)
    (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if "tokenizer" in m["name"]]
    assert (mount["mountPath"], mount["readOnly"]) == (llama["tokenizer"], True)
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"] == {"name": "llama-tokenizer"}


def test_a_tokenizer_from_any_volume(tmp_path: Path):
    claim = {"persistentVolumeClaim": {"claimName": "llama-tokenizer", "readOnly": True}}
    values = changed(model={"tokenizer": {"volume": claim}})
    manifests = render(values, tmp_path)
    spec = gateway_pod(manifests)
    (volume,) = [v for v in spec["volumes"] if v["name"].startswith("tokenizer")]
    assert volume == {"name": volume["name"], **claim}
    assert schema_problems(manifests, KUBERNETES_VERSIONS[-1], tmp_path) == []


def test_the_gateway_loader_takes_the_rendered_config(tmp_path: Path):
    manifests = render(VALUES, tmp_path)
    raw = yaml.safe_load(one(manifests, "ConfigMap", FULLNAME)["data"]["config.yaml"])
    # the tokenizer files as the ConfigMap would hold them, where the pod mounts them
    model = build_tiny_model(tmp_path / "model", for_vllm=True)
    mounted = tmp_path / raw["models"][1]["tokenizer"].lstrip("/")
    shutil.copytree(model, mounted)
    raw["models"][1]["tokenizer"] = str(mounted)
    config = parse_config(raw, env={})
    llama = config.models[1]
    assert (llama.name, llama.upstream, llama.tokenizer) == (MODEL, "vllm-grpc", str(mounted))


@pytest.mark.parametrize(
    ("edits", "message"),
    [
        ({"pool": {"vllm": None}}, "needs vllm.model"),
        ({"pool": {"vllm": {}}}, "missing property 'model'"),
        ({"pool": {"image": {"tag": "v1"}}}, "image.repository"),
        ({"pool": {"tls": {"existingSecret": "llama-tls"}}}, "no TLS flags"),
        ({"model": {"tokenizer": None}}, "needs tokenizer"),
        ({"model": {"upstream": "grpc"}}, "its pools run vllm-grpc"),
        ({"model": {"pools": ["llama", "demo"]}}, "different engines"),
        ({"model": {"tokenizer": {"configMap": "a", "volume": {"emptyDir": {}}}}}, "tokenizer"),
        ({"pool": {"engine": "sglang"}}, "engine"),
    ],
)
def test_mistakes_fail_to_render(edits: dict[str, Any], message: str, tmp_path: Path):
    result = render(changed(**edits), tmp_path, check=False)
    assert result.returncode != 0
    assert message in result.stderr


def test_a_tokenizer_on_a_model_of_our_workers_fails_to_render(tmp_path: Path):
    values = copy.deepcopy(VALUES)
    values["models"][0]["tokenizer"] = {"configMap": "demo-tokenizer"}
    result = render(values, tmp_path, check=False)
    assert result.returncode != 0
    assert "tokenizer is for upstream vllm-grpc" in result.stderr
