"""The Kubernetes tools the deploy tests call, and checks they share.

helm, kubectl and kubernetes-validate (the Kubernetes JSON schemas, offline) are not on
PyPI as the project's dependencies are: `bash deploy/install-tools.sh` puts them in
.tools/bin (`tests.support.installed`), and CI runs it first.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.installed import ROOT, tool

#: The oldest Kubernetes the chart supports (Chart.yaml's kubeVersion) and kubectl's.
KUBERNETES_VERSIONS = ("1.27.0", "1.35.0")
#: Custom resources: no schema ships offline, so their tests check them field by field.
CRD_KINDS = frozenset({"HTTPRoute", "ServiceMonitor"})
WORKLOAD_KINDS = frozenset({"Deployment", "StatefulSet"})

Manifest = dict[str, Any]


def run(args: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Runs a tool from the repository's root; with `check`, a failure fails the test."""
    result = subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=ROOT)
    if check and result.returncode != 0:
        pytest.fail(
            f"`{' '.join(args)}` exited {result.returncode}:\n{result.stdout}\n{result.stderr}",
            pytrace=False,
        )
    return result


def load_manifests(text: str) -> list[Manifest]:
    """The objects of a multi-document YAML stream, empty documents left out."""
    return [doc for doc in yaml.safe_load_all(text) if doc]


def schema_problems(manifests: list[Manifest], version: str, workdir: Path) -> list[str]:
    """Validates every object against the strict Kubernetes schemas of `version` (unknown
    fields are errors); returns what failed, or kinds that had no schema and are no CRD."""
    path = workdir / f"manifests-{version}.yaml"
    path.write_text(yaml.safe_dump_all(manifests))
    result = run(
        [tool("kubernetes-validate"), "--strict", "--kubernetes-version", version, str(path)],
        check=False,
    )
    problems: list[str] = []
    passed = 0
    for line in result.stdout.splitlines():
        if line.startswith("INFO") and " passed " in line:
            passed += 1
        elif line.startswith("WARN") and (kind := re.search(r"kind (\w+)", line)):
            if kind.group(1) not in CRD_KINDS:
                problems.append(line)
        elif line.strip():
            problems.append(line)
    expected = sum(1 for m in manifests if m["kind"] not in CRD_KINDS)
    if passed != expected:
        problems.append(f"{passed} of {expected} objects passed:\n{result.stdout}{result.stderr}")
    return problems


def of_kind(manifests: Iterable[Manifest], *kinds: str) -> Iterator[Manifest]:
    """The objects of the given kinds."""
    return (m for m in manifests if m["kind"] in kinds)


def one(manifests: Iterable[Manifest], kind: str, name: str) -> Manifest:
    """The one object of that kind and name."""
    found = [m for m in of_kind(manifests, kind) if m["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def pod_specs(manifests: Iterable[Manifest]) -> Iterator[tuple[str, Manifest]]:
    """Every pod spec, with the name of its object: workloads' templates and bare pods."""
    for manifest in manifests:
        name = f"{manifest['kind']}/{manifest['metadata']['name']}"
        if manifest["kind"] in WORKLOAD_KINDS:
            yield name, manifest["spec"]["template"]["spec"]
        elif manifest["kind"] == "Pod":
            yield name, manifest["spec"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """Whether a label selector (`matchLabels` or a Service's) selects these labels."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def headless_address(service: Manifest, namespace: str, port: int) -> str:
    """The `dns:///` worker address of a headless Service."""
    name = service["metadata"]["name"]
    return f"dns:///{name}.{namespace}.svc.cluster.local:{port}"


def check_worker_pools(manifests: list[Manifest], namespace: str) -> set[str]:
    """Every worker workload has a headless Service that selects its pods on its gRPC
    port; returns those Services' `dns:///` addresses."""
    addresses = set()
    services = list(of_kind(manifests, "Service"))
    for workload in of_kind(manifests, *WORKLOAD_KINDS):
        template = workload["spec"]["template"]
        if template["metadata"]["labels"].get("app.kubernetes.io/component") != "worker":
            continue
        name = workload["metadata"]["name"]
        container = template["spec"]["containers"][0]
        grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
        matching = [
            s for s in services if selects(s["spec"]["selector"], template["metadata"]["labels"])
        ]
        assert len(matching) == 1, f"{name}: {len(matching)} Services select its pods"
        service = matching[0]
        assert service["spec"].get("clusterIP") == "None", f"{name}: its Service is not headless"
        assert workload["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
        (port,) = service["spec"]["ports"]
        assert port["targetPort"] in ("grpc", grpc_port) and port["port"] == grpc_port, name
        if workload["kind"] == "StatefulSet":
            assert workload["spec"]["serviceName"] == service["metadata"]["name"]
        addresses.add(headless_address(service, namespace, port["port"]))
    return addresses


def check_restricted(manifests: list[Manifest]) -> None:
    """Every pod: no service account token, a non-root user, every capability dropped,
    no privilege escalation, a read-only root filesystem."""
    specs = list(pod_specs(manifests))
    assert specs
    for name, spec in specs:
        assert spec["automountServiceAccountToken"] is False, name
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["runAsUser"] != 0, name
        for container in spec["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, name
            assert context["readOnlyRootFilesystem"] is True, name
            assert context["capabilities"]["drop"] == ["ALL"], name
    for account in of_kind(manifests, "ServiceAccount"):
        assert account["automountServiceAccountToken"] is False


def prestop_sleep(container: Manifest) -> int:
    """The seconds of a container's `sleep N` preStop pause."""
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep", command
    return int(command[1])
