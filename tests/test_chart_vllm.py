"""The chart with a pool of stock vLLM gRPC servers next to a pool of our workers, with
the real helm: it lints and validates against the Kubernetes schemas, the vLLM pool runs
`python3 -m vllm.entrypoints.grpc_server` on its port with its GPUs and gRPC health
probes, its model reaches it with `upstream: vllm-grpc` and the tokenizer files mounted
from a ConfigMap or a volume, the gateway's loader takes the rendered config, and the
mistakes (no model, no image, TLS, no tokenizer, mixed engines) fail to render. Every
setting of a model's entry (`routing`, `queue`, tool calls, an HTTP upstream's key, CA and
KV events) goes through `models[]`: the schema refuses what the loader would, the chart
mounts the files and passes the Secret the entry names, and the loader takes the result.
Prefill/decode disaggregation: pools with a `vllm.kvRole` run vLLM's NixlConnector in that
role with their side channel at the pod's IP, a prefilling pool's NetworkPolicy lets the
decoding pools reach it, a model's `prefillPools` become its `prefill_workers`, and each
mismatch of roles, engines and upstreams fails to render."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import QueueConfig, RoutingConfig, parse_config
from tests.support.certs import CertificateAuthority
from tests.support.k8s_tools import (
    KUBERNETES_VERSIONS,
    ROOT,
    Manifest,
    check_restricted,
    check_worker_pools,
    headless_address,
    load_manifests,
    of_kind,
    one,
    run,
    schema_problems,
    selects,
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


HOSTED_URL = "https://vllm-0.inference.svc:8000/v1"
HOSTED_PREFILL_URL = "https://vllm-prefill-0.inference.svc:8000/v1"
#: Every setting of a model's entry through the chart's `models[]`: routing on our workers
#: (issue 26's contract, `routing: {policy: kv_aware}`) and, with its weights, on the vLLM
#: pool; a queue over the top-level one; vLLM's tool calls; and a vLLM HTTP server with
#: its key, its private CA and its ZMQ KV events.
EVERY_SETTING: dict[str, Any] = {
    **copy.deepcopy(VALUES),
    "gateway": {"config": {"queue": {"max_wait": 5}}},
    "models": [
        {"name": "furnace-demo", "pools": ["demo"], "routing": {"policy": "kv_aware"}},
        {
            **VALUES["models"][1],
            "routing": {"policy": "kv_aware", "running_cost": 32, "max_engine_waiting": 8},
            "queue": {"max_depth": 64},
            "toolCallParser": "hermes",
            "reasoningParser": "qwen3",
            "plainTextContents": False,
        },
        {
            "name": "hosted",
            "upstream": "openai",
            "workers": [HOSTED_URL],
            "prefillWorkers": [HOSTED_PREFILL_URL],
            "apiKey": {"existingSecret": "hosted-key", "key": "token"},
            "ca": {"configMap": "internal-ca", "key": "bundle.pem"},
            "tokenizer": {"configMap": "qwen-tokenizer"},
            "dataParallelSize": 4,
            "routing": {
                "policy": "least_load",
                "kv_events": {HOSTED_URL: "tcp://vllm-0.inference.svc:5557"},
                "kv_replay": {HOSTED_URL: "tcp://vllm-0.inference.svc:5558"},
            },
            "prefillRouting": {
                "policy": "kv_aware",
                "kv_events": {HOSTED_PREFILL_URL: "tcp://vllm-prefill-0.inference.svc:5557"},
            },
        },
    ],
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
    edit(targets, edits)
    return values


def edit(targets: dict[str, dict[str, Any]], edits: dict[str, dict[str, Any]]) -> None:
    """Each of `targets` (a pool's or a model's values) with the fields of its `edits`
    replaced (None: removed)."""
    for where, fields in edits.items():
        for key, value in fields.items():
            if value is None:
                targets[where].pop(key, None)
            else:
                targets[where][key] = value


def gateway_pod(manifests: list[Manifest]) -> Manifest:
    return one(manifests, "Deployment", FULLNAME)["spec"]["template"]["spec"]


def fleet(name: str) -> dict[str, Any]:
    """The values of a fleet the specs below render: `vllm` (a vLLM pool beside our
    workers), or `disaggregated` (prefill and decode pools)."""
    return VALUES if name == "vllm" else DISAGGREGATED


@pytest.mark.parametrize("name", ["vllm", "disaggregated"])
def test_lints_strict(name: str, tmp_path: Path):
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(fleet(name)))
    result = run([tool("helm"), "lint", "--strict", str(CHART), "-f", str(path)])
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("name", ["vllm", "disaggregated"])
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_matches_the_kubernetes_schemas(version: str, name: str, tmp_path: Path):
    manifests = render(fleet(name), tmp_path)
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


def test_every_model_setting_reaches_the_gateway_loader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    manifests = render(EVERY_SETTING, tmp_path)
    raw = yaml.safe_load(one(manifests, "ConfigMap", FULLNAME)["data"]["config.yaml"])
    # the files and the Secret as the pod would have them, where the chart puts them
    tokenizer = build_tiny_model(tmp_path / "model", for_vllm=True)
    for entry in raw["models"][1:]:
        mounted = tmp_path / entry["tokenizer"].lstrip("/")
        entry["tokenizer"] = str(shutil.copytree(tokenizer, mounted))
    hosted = raw["models"][2]
    rendered_ca = Path(hosted["ca_file"])
    ca_file = tmp_path / hosted["ca_file"].lstrip("/")
    ca_file.parent.mkdir(parents=True)
    shutil.copy(CertificateAuthority(tmp_path, "internal-ca").ca_file, ca_file)
    monkeypatch.setenv(hosted["api_key_env"], "sk-upstream")
    hosted["ca_file"] = str(ca_file)

    demo, llama, openai = parse_config(raw, env={}).models
    assert demo.routing == RoutingConfig(policy="kv_aware")
    assert demo.queue == QueueConfig(max_wait=5)
    assert llama.routing == RoutingConfig(running_cost=32, max_engine_waiting=8)
    assert llama.queue == QueueConfig(max_wait=5, max_depth=64)
    assert (llama.tool_call_parser, llama.plain_text_contents) == ("hermes", False)
    assert llama.reasoning_parser == "qwen3"
    assert openai.routing is not None and openai.routing.policy == "least_load"
    assert openai.routing.kv_events == ((HOSTED_URL, "tcp://vllm-0.inference.svc:5557"),)
    assert openai.prefill_workers == (HOSTED_PREFILL_URL,)
    assert openai.prefill_routing == RoutingConfig(
        kv_events=((HOSTED_PREFILL_URL, "tcp://vllm-prefill-0.inference.svc:5557"),)
    )
    assert openai.routing.kv_replay == ((HOSTED_URL, "tcp://vllm-0.inference.svc:5558"),)
    assert openai.tokenizer is not None and openai.ca_file == str(ca_file)
    assert (openai.data_parallel_size, llama.data_parallel_size) == (4, 1)
    # the pod holds what the entry names: the key's variable, the CA's directory
    spec = gateway_pod(manifests)
    (container,) = spec["containers"]
    (key,) = [e for e in container["env"] if e["name"] == openai.api_key_env]
    assert key["valueFrom"] == {"secretKeyRef": {"name": "hosted-key", "key": "token"}}
    (mount,) = [m for m in container["volumeMounts"] if m["name"].startswith("upstream-ca")]
    assert (mount["mountPath"], mount["readOnly"]) == (str(rendered_ca.parent), True)
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    items = [{"key": "bundle.pem", "path": rendered_ca.name}]
    assert volume["configMap"] == {"name": "internal-ca", "items": items}
    assert schema_problems(manifests, KUBERNETES_VERSIONS[-1], tmp_path) == []


@pytest.mark.parametrize(
    "edits",
    [
        {"routing": {"policy": "fastest"}},
        {"routing": {"max_kv_usage": 1.5}},
        {"routing": {"kv_event": {}}},
        {"routing": {"kv_events": {HOSTED_URL: "vllm-0:5557"}}},
        {"queue": {"max_depth": 0}},
        {"queue": {"max_wait": 1, "depth": 4}},
        {"toolCallParser": "mistral"},
        {"reasoningParser": "granite"},
        {"plainTextContents": "no"},
        {"dataParallelSize": 0},
        {"apiKey": {"key": "token"}},
        {"ca": {"configMap": "a", "existingSecret": "b"}},
    ],
)
def test_the_schema_refuses_bad_model_settings(edits: dict[str, Any], tmp_path: Path):
    result = render(changed(model=edits), tmp_path, check=False)
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr


def test_without_prefill_routing_routing_names_both_tiers_publishers(tmp_path: Path):
    values = copy.deepcopy(EVERY_SETTING)
    hosted = values["models"][2]
    prefill = hosted.pop("prefillRouting")
    hosted["routing"]["kv_events"].update(prefill["kv_events"])
    manifests = render(values, tmp_path)
    raw = yaml.safe_load(one(manifests, "ConfigMap", FULLNAME)["data"]["config.yaml"])
    assert raw["models"][2]["routing"]["kv_events"] == {
        HOSTED_URL: "tcp://vllm-0.inference.svc:5557",
        HOSTED_PREFILL_URL: "tcp://vllm-prefill-0.inference.svc:5557",
    }
    assert "prefill_routing" not in raw["models"][2]


@pytest.mark.parametrize(
    ("index", "edits", "message"),
    [
        (0, {"toolCallParser": "hermes"}, "models[0].toolCallParser: only for upstream vllm-grpc"),
        (0, {"reasoningParser": "qwen3"}, "models[0].reasoningParser: only for upstream vllm-grpc"),
        (0, {"plainTextContents": True}, "models[0].plainTextContents: only for upstream"),
        (1, {"apiKey": {"existingSecret": "k"}}, "apiKey and ca are for upstream openai"),
        (1, {"ca": {"configMap": "ca"}}, "apiKey and ca are for upstream openai"),
        (2, {"tokenizer": None}, "kv_events needs tokenizer"),
        (
            2,
            {"routing": None, "prefillRouting": None},
            "tokenizer is for upstream vllm-grpc (the gateway tokenizes) or",
        ),
        (2, {"workers": ["https://other:8000/v1"]}, "is not one of the model's workers"),
        (  # the prefill tier's own routing names its own publishers
            2,
            {"prefillRouting": {"kv_events": {HOSTED_URL: "tcp://h:1"}}},
            'prefillRouting.kv_events: "https://vllm-0.inference.svc:8000/v1" is not one of '
            "the model's prefillWorkers",
        ),
        (2, {"prefillWorkers": None, "prefillRouting": {}}, "prefillRouting: only with"),
        (0, {"dataParallelSize": 2}, "models[0].dataParallelSize: only for upstream openai"),
        (2, {"routing": {"kv_replay": {HOSTED_URL: "tcp://h:1"}}}, "not one of routing.kv_events"),
    ],
)
def test_model_setting_mistakes_fail_to_render(
    index: int, edits: dict[str, Any], message: str, tmp_path: Path
):
    values = copy.deepcopy(EVERY_SETTING)
    model = values["models"][index]
    for key, value in edits.items():
        if value is None:
            del model[key]
        else:
            model[key] = value
    result = render(values, tmp_path, check=False)
    assert result.returncode != 0
    assert message in result.stderr


@pytest.mark.parametrize(
    ("edits", "message"),
    [
        ({"model": {"queue": {"max_depth": 4}}}, "needs max_wait, as gateway.config has no queue"),
        ({"pool": {"vllm": None}}, "needs vllm.model"),
        ({"pool": {"vllm": {}}}, "missing property 'model'"),
        ({"pool": {"image": {"tag": "v1"}}}, "image.repository"),
        ({"pool": {"tls": {"existingSecret": "llama-tls"}}}, "no TLS flags"),
        ({"model": {"tokenizer": None}}, "needs tokenizer"),
        ({"model": {"upstream": "grpc"}}, "its pools run vllm-grpc"),
        ({"model": {"pools": ["llama", "demo"]}}, "different engines"),
        ({"model": {"tokenizer": {"configMap": "a", "volume": {"emptyDir": {}}}}}, "tokenizer"),
        ({"pool": {"engine": "sglang"}}, "engine"),
        ({"pool": {"args": ["-dp", "two"]}}, "workerPools.llama.args: --data-parallel-size two"),
        (
            {"pool": {"args": ["-dp", "2"]}, "model": {"dataParallelSize": 4}},
            'models[1].dataParallelSize: 4, but workerPools "llama" runs 2 data-parallel',
        ),
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


PREFILL_POOL = f"{FULLNAME}-worker-llama-prefill"
LLAMA_POOL = VALUES["workerPools"]["llama"]
#: Prefill/decode disaggregation: a pool of vLLM gRPC servers that prefill (kv_producer, its
#: side channel on a port of its own) and the model's pool that decodes (kv_consumer, the
#: default port), the model naming the first in `prefillPools`.
DISAGGREGATED: dict[str, Any] = {
    "models": [
        {"name": "furnace-demo", "pools": ["demo"]},
        {**VALUES["models"][1], "prefillPools": ["llama-prefill"]},
    ],
    "workerPools": {
        "llama": {
            **LLAMA_POOL,
            "vllm": {**LLAMA_POOL["vllm"], "kvRole": "kv_consumer"},
        },
        "llama-prefill": {
            **LLAMA_POOL,
            "replicas": 2,
            "vllm": {**LLAMA_POOL["vllm"], "kvRole": "kv_producer", "nixlSideChannelPort": 5601},
        },
    },
}


def split(**edits: Any) -> dict[str, Any]:
    """DISAGGREGATED with fields of the `prefill` or `decode` pool, the `demo` pool, the
    disaggregated `model` or the `demo_model` replaced (None: removed)."""
    values = copy.deepcopy(DISAGGREGATED)
    pools = values["workerPools"]
    pools["demo"] = {}
    targets = {
        "prefill": pools["llama-prefill"],
        "decode": pools["llama"],
        "demo": pools["demo"],
        "model": values["models"][1],
        "demo_model": values["models"][0],
    }
    edit(targets, edits)
    if not pools["demo"]:
        del pools["demo"]
    return values


def worker(manifests: list[Manifest], name: str) -> Manifest:
    (container,) = one(manifests, "Deployment", name)["spec"]["template"]["spec"]["containers"]
    return container


@pytest.mark.parametrize(
    ("pool", "role", "port"), [(PREFILL_POOL, "kv_producer", 5601), (POOL, "kv_consumer", 5600)]
)
def test_each_tier_runs_vllm_with_nixl_in_its_role(pool: str, role: str, port: int, tmp_path: Path):
    container = worker(render(DISAGGREGATED, tmp_path), pool)
    assert container["command"] == ["python3", "-m", "vllm.entrypoints.grpc_server"]
    args = container["args"]
    model = "meta-llama/Meta-Llama-3-8B-Instruct"
    assert args[:6] == ["--model", model, "--host", "0.0.0.0", "--port", "50061"]
    assert args[6] == "--kv-transfer-config"
    assert json.loads(args[7]) == {"kv_connector": "NixlConnector", "kv_role": role}
    assert args[8:] == ["--max-model-len", "8192"]  # the pool's own args after
    # the side channel, where decode servers ask for blocks: the pod's IP, the pool's port
    env = {e["name"]: e for e in container["env"]}
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "status.podIP"}
    }
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == str(port)
    assert container["ports"] == [
        {"name": "grpc", "containerPort": 50061, "protocol": "TCP"},
        {"name": "nixl", "containerPort": port, "protocol": "TCP"},
    ]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": 50061}


def test_a_pool_without_a_kv_role_runs_no_connector(tmp_path: Path):
    container = worker(render(VALUES, tmp_path), POOL)
    assert "--kv-transfer-config" not in container["args"]
    assert not [e for e in container["env"] if e["name"].startswith("VLLM_NIXL")]
    assert [p["name"] for p in container["ports"]] == ["grpc"]


@pytest.mark.parametrize(
    "flag", [["--data-parallel-size", "2"], ["--data-parallel-size=2"], ["-dp", "2"]]
)
def test_pools_of_data_parallel_servers_make_each_engine_a_worker(flag: list[str], tmp_path: Path):
    """A model whose vLLM pools run `--data-parallel-size N` (each tier the same N) gets
    `data_parallel_size: N` (each engine a worker of its own) without saying it."""
    values = split(decode={"args": flag}, prefill={"args": flag})
    manifests = render(values, tmp_path)
    raw = yaml.safe_load(one(manifests, "ConfigMap", FULLNAME)["data"]["config.yaml"])
    assert raw["models"][1]["data_parallel_size"] == 2
    assert "data_parallel_size" not in raw["models"][0]
    assert worker(manifests, POOL)["args"][-len(flag) :] == flag
    said = copy.deepcopy(values)
    said["models"][1]["dataParallelSize"] = 2  # said as well: the same
    raw = yaml.safe_load(one(render(said, tmp_path), "ConfigMap", FULLNAME)["data"]["config.yaml"])
    assert raw["models"][1]["data_parallel_size"] == 2
    plain = yaml.safe_load(
        one(render(DISAGGREGATED, tmp_path), "ConfigMap", FULLNAME)["data"]["config.yaml"]
    )
    assert "data_parallel_size" not in plain["models"][1]


def test_the_model_prefills_on_its_prefill_pools_and_the_loader_takes_it(tmp_path: Path):
    manifests = render(DISAGGREGATED, tmp_path)
    raw = yaml.safe_load(one(manifests, "ConfigMap", FULLNAME)["data"]["config.yaml"])
    llama = raw["models"][1]
    services = {s["metadata"]["name"]: s for s in of_kind(manifests, "Service")}
    prefill = headless_address(services[PREFILL_POOL], NAMESPACE, 50061)
    decode = headless_address(services[POOL], NAMESPACE, 50061)
    assert (llama["workers"], llama["prefill_workers"]) == ([decode], [prefill])
    assert {prefill, decode} <= check_worker_pools(manifests, NAMESPACE)
    assert "prefill_workers" not in raw["models"][0]
    model = build_tiny_model(tmp_path / "model", for_vllm=True)
    llama["tokenizer"] = str(shutil.copytree(model, tmp_path / llama["tokenizer"].lstrip("/")))
    parsed = parse_config(raw, env={}).models[1]
    assert (parsed.upstream, parsed.workers, parsed.prefill_workers) == (
        "vllm-grpc",
        (decode,),
        (prefill,),
    )


def test_prefill_workers_outside_the_chart_follow_the_pools(tmp_path: Path):
    values = split(model={"prefillWorkers": ["vllm-prefill-9.other.svc:50061"]})
    raw = yaml.safe_load(
        one(render(values, tmp_path), "ConfigMap", FULLNAME)["data"]["config.yaml"]
    )
    assert raw["models"][1]["prefill_workers"] == [
        f"dns:///{PREFILL_POOL}.{NAMESPACE}.svc.cluster.local:50061",
        "vllm-prefill-9.other.svc:50061",
    ]


def test_decode_pods_reach_the_prefill_pods_side_channel(tmp_path: Path):
    manifests = render(DISAGGREGATED, tmp_path)
    labels = {
        name: one(manifests, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        for name in (PREFILL_POOL, POOL, f"{FULLNAME}-worker-demo", FULLNAME)
    }
    policy = one(manifests, "NetworkPolicy", PREFILL_POOL)["spec"]
    assert selects(policy["podSelector"]["matchLabels"], labels[PREFILL_POOL])
    grpc, nixl = policy["ingress"]
    assert grpc["ports"] == [{"port": "grpc", "protocol": "TCP"}]
    assert nixl["ports"] == [{"port": "nixl", "protocol": "TCP"}]
    (peer,) = nixl["from"]
    assert set(peer) == {"podSelector"}  # the release's decode pods alone, no namespace
    allowed = {n for n, pod in labels.items() if selects(peer["podSelector"]["matchLabels"], pod)}
    assert allowed == {POOL}
    # a decode pool serves no blocks: its policy keeps the gRPC port alone
    (decode_rule,) = one(manifests, "NetworkPolicy", POOL)["spec"]["ingress"]
    assert decode_rule["ports"] == [{"port": "grpc", "protocol": "TCP"}]


def test_kv_both_pools_take_the_side_channel_from_each_other(tmp_path: Path):
    both = {"vllm": {**LLAMA_POOL["vllm"], "kvRole": "kv_both"}}
    manifests = render(split(prefill=both, decode=both), tmp_path)
    names = (PREFILL_POOL, POOL)
    labels = [
        one(manifests, "Deployment", n)["spec"]["template"]["metadata"]["labels"] for n in names
    ]
    for name in names:
        *_, nixl = one(manifests, "NetworkPolicy", name)["spec"]["ingress"]
        selectors = [peer["podSelector"]["matchLabels"] for peer in nixl["from"]]
        assert [any(selects(s, pod) for s in selectors) for pod in labels] == [True, True]


def vllm(**fields: Any) -> dict[str, Any]:
    """A pool's `vllm` of the Llama model with these fields."""
    return {"vllm": {**LLAMA_POOL["vllm"], **fields}}


@pytest.mark.parametrize(
    ("edits", "message"),
    [
        (
            {"model": {"prefillPools": ["gone"]}},
            'models[1].prefillPools: "gone" is not a key of workerPools',
        ),
        ({"prefill": {"enabled": False}}, 'worker pool "llama-prefill" is disabled'),
        (
            {"model": {"prefillPools": ["demo"]}, "demo": {"enabled": True}},
            'models[1].prefillPools: the worker pool "demo" runs furnace, not vllm-grpc',
        ),
        (
            {"demo_model": {"prefillPools": ["llama-prefill"]}},
            "models[0].prefillPools: only for upstream vllm-grpc",
        ),
        (
            {"prefill": vllm(kvRole="kv_consumer")},
            'the worker pool "llama-prefill" prefills: it needs vllm.kvRole kv_producer or '
            "kv_both, not kv_consumer",
        ),
        ({"prefill": vllm()}, "vllm.kvRole kv_producer or kv_both, not none"),
        (
            {"decode": vllm(kvRole="kv_producer")},
            'models[1].pools: the worker pool "llama" decodes what prefillPools prefill: '
            "it needs vllm.kvRole kv_consumer or kv_both, not kv_producer",
        ),
        ({"decode": vllm()}, "vllm.kvRole kv_consumer or kv_both, not none"),
        (
            {"demo": {"enabled": True, "vllm": {"model": "m", "kvRole": "kv_both"}}},
            "workerPools.demo.vllm.kvRole: only for engine vllm-grpc",
        ),
        (
            {"prefill": vllm(kvRole="kv_sender")},
            "value must be one of 'kv_producer', 'kv_consumer', 'kv_both'",
        ),
        (
            {"prefill": vllm(nixlSideChannelPort=5600)},
            "workerPools.llama-prefill.vllm.nixlSideChannelPort: needs vllm.kvRole",
        ),
        (
            {"prefill": vllm(kvRole="kv_producer", nixlSideChannelPort=50061)},
            "workerPools.llama-prefill.vllm.nixlSideChannelPort: 50061 is the pool's gRPC port",
        ),
        (
            {"prefill": {"args": ["--kv-transfer-config", "{}"]}},
            "workerPools.llama-prefill.args: vllm.kvRole passes --kv-transfer-config",
        ),
        (
            {"decode": {"env": [{"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "value": "localhost"}]}},
            "workerPools.llama.env: vllm.kvRole sets VLLM_NIXL_SIDE_CHANNEL_HOST",
        ),
        (
            {"decode": {"args": ["--data-parallel-size", "2"]}},
            'models[1]: workerPools "llama" and "llama-prefill" run 2 and 1 data-parallel engines',
        ),
    ],
)
def test_disaggregation_mistakes_fail_to_render(
    edits: dict[str, Any], message: str, tmp_path: Path
):
    result = render(split(**edits), tmp_path, check=False)
    assert result.returncode != 0
    assert message in result.stderr


def test_an_openai_model_takes_prefill_workers_not_pools(tmp_path: Path):
    values = copy.deepcopy(DISAGGREGATED)
    hosted = {"name": "hosted", "upstream": "openai", "workers": [HOSTED_URL]}
    values["models"].append({**hosted, "prefillPools": ["llama-prefill"]})
    result = render(values, tmp_path, check=False)
    assert result.returncode != 0
    assert "models[2].prefillPools: only for upstream vllm-grpc" in result.stderr
    assert "not openai" in result.stderr


@pytest.mark.parametrize(
    "field", [{"prefillPools": ["llama-prefill"]}, {"prefillWorkers": ["vllm-prefill-1:50061"]}]
)
def test_an_adapter_takes_no_prefill_workers(field: dict[str, list[str]], tmp_path: Path):
    values = copy.deepcopy(DISAGGREGATED)
    values["models"].append({"name": "a", "adapterOf": MODEL, **field})
    result = render(values, tmp_path, check=False)
    assert result.returncode != 0
    (name,) = field
    assert f"models[2].{name}: an adapter (adapterOf) takes its base model's" in result.stderr
