"""What ships besides the chart: the Dockerfile (read, since no Docker engine runs here,
and its commands run through the real CLI; it installs what the chart's options need), the
kustomize base (built with the real kubectl, schema-validated) and the example configs
(through the gateway's own loader)."""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from starlette.routing import Route

from gateway import lifecycle
from gateway.config import load_config, parse_config
from tests.support.installed import ai_sdk
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
    tool,
)

DOCKERFILE = ROOT / "deploy" / "Dockerfile"
KUSTOMIZE = ROOT / "deploy" / "kustomize" / "base"
CHART_VALUES = ROOT / "helm" / "furnace-gateway" / "values.yaml"
CONFIG_PATH = "/etc/furnace/config.yaml"

Stage = list[tuple[str, str]]


def dockerfile_stages() -> tuple[dict[str, str], list[Stage]]:
    """The Dockerfile's global ARG defaults and its stages, each a list of (INSTRUCTION,
    arguments) with continuation lines joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    current = ""
    for line in DOCKERFILE.read_text().splitlines():
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if text.endswith("\\"):
            current += text[:-1] + " "
            continue
        keyword, _, arguments = (current + text).partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
        current = ""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for keyword, arguments in instructions:
        if keyword == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((keyword, arguments))
        elif keyword == "ARG":
            name, _, default = arguments.partition("=")
            args[name] = default
    return args, stages


def final_stage() -> Stage:
    """The instructions of the image's last stage."""
    return dockerfile_stages()[1][-1]


def exec_form(stage: Stage, keyword: str) -> list[str]:
    """The JSON (exec) form of the stage's last ENTRYPOINT or CMD."""
    (arguments,) = [a for k, a in stage if k == keyword][-1:]
    value = json.loads(arguments)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), arguments
    return value


def cli_help(command: list[str]) -> subprocess.CompletedProcess[str]:
    """Runs a `furnace-gateway ...` command line with `--help` appended through the real
    CLI (`python -m gateway`): it parses every option before it, then exits 0."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts[command[0]] == "gateway.cli:main", command
    return subprocess.run(
        [sys.executable, "-m", "gateway", *command[1:], "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )


@functools.cache
def kustomize_manifests() -> tuple[Manifest, ...]:
    """The kustomize base, built by the real kubectl."""
    return tuple(load_manifests(run([tool("kubectl"), "kustomize", str(KUSTOMIZE)]).stdout))


def test_the_image_is_multi_stage_on_a_pinned_slim_python_3_11():
    args, stages = dockerfile_stages()
    assert re.fullmatch(r"python:3\.11\.\d+-slim-[a-z]+", args["PYTHON_IMAGE"])
    assert len(stages) >= 2
    for stage in stages:
        assert stage[0][1].split()[0] == "${PYTHON_IMAGE}", stage[0]
    copied = [a for k, a in final_stage() if k == "COPY"]
    assert any(a.startswith("--from=build ") for a in copied), copied


def test_the_final_stage_runs_unbuffered_as_a_user_with_no_build_tools():
    stage = final_stage()
    env = " ".join(a for k, a in stage if k == "ENV")
    assert re.search(r"\bPYTHONUNBUFFERED=1\b", env)
    (user,) = [a for k, a in stage if k == "USER"]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0  # numeric, so runAsNonRoot can check it
    runs = " ".join(a for k, a in stage if k == "RUN")
    for build_tool in ("gcc", "g++", "build-essential", "make ", "git ", "pip "):
        assert build_tool not in runs
    assert "--no-install-recommends" in runs and "rm -rf /var/lib/apt/lists/*" in runs


def test_the_entrypoint_forwards_sigterm_in_exec_form():
    stage = final_stage()
    entrypoint = exec_form(stage, "ENTRYPOINT")
    assert entrypoint == ["/usr/bin/tini", "--"]
    assert "install -y --no-install-recommends tini" in " ".join(a for k, a in stage if k == "RUN")


def test_the_default_command_is_the_gateway_of_the_cli():
    command = exec_form(final_stage(), "CMD")
    assert command == ["furnace-gateway", "serve", "--config", CONFIG_PATH]
    result = cli_help(command)
    assert result.returncode == 0, result.stderr
    assert "--config" in result.stdout


@pytest.mark.parametrize("source", ["chart", "kustomize", "dockerfile-usage"])
def test_the_worker_commands_exist_in_the_cli(source: str):
    if source == "chart":
        command = yaml.safe_load(CHART_VALUES.read_text())["workerPools"]["demo"]["args"]
    elif source == "kustomize":
        (worker,) = (
            d
            for d in of_kind(kustomize_manifests(), "Deployment")
            if d["metadata"]["name"] == "furnace-worker-demo"
        )
        command = worker["spec"]["template"]["spec"]["containers"][0]["args"]
    else:
        lines = DOCKERFILE.read_text().splitlines()
        (line,) = [ln for ln in lines if "furnace-gateway worker " in ln]
        command = line[line.index("furnace-gateway") :].split()
    assert command[:2] == ["furnace-gateway", "worker"]
    result = cli_help(command)
    assert result.returncode == 0, result.stderr
    assert command[command.index("--port") + 1] == "50051"


def test_the_chart_and_kustomize_run_the_image_command_on_the_mounted_config():
    command = exec_form(final_stage(), "CMD")
    (gateway,) = (
        d
        for d in of_kind(kustomize_manifests(), "Deployment")
        if d["metadata"]["name"] == "furnace-gateway"
    )
    container = gateway["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == command
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    assert f"{mount['mountPath']}/config.yaml" == CONFIG_PATH
    chart_deployment = (ROOT / "helm/furnace-gateway/templates/deployment.yaml").read_text()
    assert f"args: {json.dumps(command)}" in chart_deployment


def test_the_build_context_admits_what_the_build_copies():
    admitted = {
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    build = dockerfile_stages()[1][0]
    sources = [
        s for k, a in build if k == "COPY" and not a.startswith("--") for s in a.split()[:-1]
    ]
    assert sources and set(sources) <= admitted
    readme = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["readme"]
    assert readme in sources  # the package build reads it


def test_the_image_installs_what_the_charts_tracing_option_needs():
    """The chart's values take `gateway.config.tracing: true`, and a gateway with tracing on
    and no OpenTelemetry refuses to start: the image installs the `otel` extra (the SDK and
    the OTLP exporter the gateway imports) and fails its build if the exporter is missing."""
    schema = json.loads((ROOT / "helm/furnace-gateway/values.schema.json").read_text())
    assert "tracing" in schema["properties"]["gateway"]["properties"]["config"]["properties"]
    build = dockerfile_stages()[1][0]
    runs = " ".join(a for k, a in build if k == "RUN")
    installed = re.search(r'pip install [^&]* "?/src\[([a-z,]+)\]"?', runs)
    assert installed, runs
    extras = installed.group(1).split(",")
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    required = {
        re.split(r"[=<>~!\[ ;]", requirement)[0]
        for extra in extras
        for requirement in optional["optional-dependencies"][extra]
    }
    assert {"opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-grpc"} <= required
    assert "import opentelemetry.exporter.otlp.proto.grpc.trace_exporter" in runs


def test_the_image_exposes_the_ports_the_manifests_use():
    (exposed,) = [a for k, a in final_stage() if k == "EXPOSE"]
    values = yaml.safe_load(CHART_VALUES.read_text())
    ports = {str(values["gateway"]["port"]), str(values["workerPools"]["demo"]["port"])}
    assert ports == set(exposed.split())


def test_the_example_config_loads():
    config = load_config(ROOT / "deploy" / "config.example.yaml", env={})
    assert [m.name for m in config.models] == ["llama-3-8b", "furnace-demo", "resnet-50"]
    assert config.models[0].workers[0].startswith("dns:///")
    assert config.models[2].kind == "tensor"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_kustomize_base_matches_the_kubernetes_schemas(version: str, tmp_path: Path):
    assert schema_problems(list(kustomize_manifests()), version, tmp_path) == []


def test_the_kustomize_base_runs_a_gateway_and_its_demo_pool():
    manifests = list(kustomize_manifests())
    check_restricted(manifests)
    (configmap,) = of_kind(manifests, "ConfigMap")
    assert configmap["metadata"]["name"].startswith("furnace-gateway-config-")  # hashed
    raw = yaml.safe_load(configmap["data"]["config.yaml"])
    config = parse_config(raw, env={})
    assert config == load_config(KUSTOMIZE / "config.yaml", env={})
    namespace = one(manifests, "Namespace", "furnace")["metadata"]["name"]
    addresses = check_worker_pools(manifests, namespace)
    assert addresses == {w for m in config.models for w in m.workers}

    pod = one(manifests, "Deployment", "furnace-gateway")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "config")
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    container = pod["containers"][0]
    assert container["ports"][0]["containerPort"] == config.port
    paths = {r.path for r in lifecycle.Gateway(config).app.routes if isinstance(r, Route)}
    probes = [container[p]["httpGet"]["path"] for p in ("livenessProbe", "readinessProbe")]
    assert probes == ["/health", "/ready"]
    assert set(probes) <= paths
    grace = pod["terminationGracePeriodSeconds"]
    assert grace > prestop_sleep(container) + config.drain_timeout


def test_install_tools_leaves_installed_tools_alone():
    tool("helm")
    tool("kubectl")
    tool("kubernetes-validate")
    tool("claude")
    tool("codex")
    ai_sdk()
    result = run(["bash", "deploy/install-tools.sh"])
    # helm and kubectl, kubernetes-validate, redis-server, prometheus, vLLM, Claude Code,
    # Codex, the AI SDK, KServe: nothing fetched again
    assert result.stderr.count("already installed") == 9, result.stderr
