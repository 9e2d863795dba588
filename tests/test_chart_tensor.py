"""The chart with a tensor pool (our ONNX worker, KServe v2 gRPC) beside an LLM pool, with
the real helm: it validates against the Kubernetes schemas, the pool has its GPU and gRPC
probes, and the tensor model reaches it with `upstream: kserve-grpc` in a config the
gateway's loader takes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from gateway.config import parse_config
from tests.support.k8s_tools import (
    KUBERNETES_VERSIONS,
    ROOT,
    check_restricted,
    load_manifests,
    one,
    run,
    schema_problems,
    tool,
)

CHART = ROOT / "helm" / "furnace-gateway"
RELEASE = "gpu"
FULLNAME = f"{RELEASE}-furnace-gateway"
ARGS = ["furnace-gateway", "worker", "--engine", "onnx", "--model-path", "/models/m.onnx"]
VALUES: dict[str, Any] = {
    "models": [
        {"name": "furnace-demo", "pools": ["demo"]},
        {"name": "resnet-50", "kind": "tensor", "pools": ["resnet"]},
    ],
    "workerPools": {
        "resnet": {
            "args": [*ARGS, "--model", "resnet-50", "--port", "50071"],
            "port": 50071,
            "gpu": {"count": 1},
        }
    },
}


def render(tmp_path: Path) -> Any:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(VALUES))
    args = [tool("helm"), "template", RELEASE, str(CHART), "-n", "inference", "-f", str(path)]
    return load_manifests(run(args).stdout)


def test_the_tensor_pool_and_its_model(tmp_path: Path):
    manifests = render(tmp_path)
    assert schema_problems(manifests, KUBERNETES_VERSIONS[-1], tmp_path) == []
    check_restricted(manifests)
    workload = one(manifests, "Deployment", f"{FULLNAME}-worker-resnet")
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["readinessProbe"]["grpc"] == {"port": 50071}
    raw = yaml.safe_load(one(manifests, "ConfigMap", FULLNAME)["data"]["config.yaml"])
    (model,) = [m for m in raw["models"] if m["name"] == "resnet-50"]
    assert model["upstream"] == "kserve-grpc"
    assert model["kind"] == "tensor"
    assert model["workers"][0].startswith("dns:///")
    config = parse_config(raw, env={})
    assert config.models[1].upstream == "kserve-grpc"
