"""Tensor models end to end: the KServe v2 REST routes of the gateway in front of a real
third-party KServe v2 gRPC server (KServe's own model server, tests/support/kserve_model.py)."""

import threading

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import ModelConfig
from tests.support.kserve import EDGE_VALUES, KServeServer
from tests.support.waiting import HANG_GUARD, wait_until


@pytest.fixture(scope="module")
def kserve(tmp_path_factory):
    server = KServeServer(tmp_path_factory.mktemp("kserve") / "server.log")
    yield server
    server.stop()


def _models(address: str) -> tuple[ModelConfig, ...]:
    return (
        ModelConfig("echo", kind="tensor", workers=(address,), upstream="kserve-grpc"),
        ModelConfig("slow", kind="tensor", workers=(address,), upstream="kserve-grpc"),
    )


@pytest.fixture
def tensor_gw(gateway_with, kserve):
    gw = gateway_with(models=_models(kserve.address))
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
        wait_until(lambda: http.get("/v2/models/echo/ready").status_code == 200, "echo ready")
        yield gw, http


def _echo_body():
    return {
        "id": "r-1",
        "inputs": [
            {"name": f"in_{d.lower()}", "datatype": d, "shape": [3], "data": v}
            for d, v in EDGE_VALUES.items()
        ],
    }


def test_every_datatype_round_trips_exactly(tensor_gw):
    _, http = tensor_gw
    response = http.post("/v2/models/echo/infer", json=_echo_body())
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model_name"] == "echo"
    assert body["id"] == "r-1"
    outputs = {o["name"]: o for o in body["outputs"]}
    for datatype, values in EDGE_VALUES.items():
        out = outputs[f"in_{datatype.lower()}"]
        assert (out["datatype"], out["shape"], out["data"]) == (datatype, [3], values)
    # INT64 beyond 2^53 stays an integer in the JSON text itself
    assert str(2**63 - 1) in response.text


def test_nested_data_is_row_major(tensor_gw):
    _, http = tensor_gw
    x = {"name": "x", "datatype": "FP32", "shape": [4], "data": [[0.0, 1.0], [2.0, 3.0]]}
    response = http.post("/v2/models/slow/versions/1/infer", json={"inputs": [x]})
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["data"] == [0.0, 1.0, 2.0, 3.0]


def test_data_nested_a_thousand_deep_is_400_not_500(tensor_gw):
    gw, http = tensor_gw
    worker = next(iter(gw.state.fleet.models["slow"].workers.values()))
    deep = "[" * 990 + "1.0" + "]" * 990
    body = '{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": ' + deep + "}]}"
    response = http.post(
        "/v2/models/slow/infer", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    assert "nested deeper than 64" in response.json()["error"]
    assert worker.outstanding == 0
    # as deep as a shape of 100 dimensions says is a tensor
    shape = [1] * 100
    x = "[" * 100 + "1.0" + "]" * 100
    tensor = f'{{"name": "x", "datatype": "FP32", "shape": {shape}, "data": {x}}}'
    body = '{"inputs": [' + tensor + "]}"
    response = http.post(
        "/v2/models/echo/infer", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text  # past the data: echo has no input x
    assert "has no input `x`" in response.json()["error"]


@pytest.mark.parametrize("content_type", ["text/plain", None, "application/x-www-form-urlencoded"])
def test_v2_bodies_must_be_json_or_binary_tensors(tensor_gw, content_type):
    _, http = tensor_gw
    body = orjson.dumps(_echo_body())
    headers = {} if content_type is None else {"content-type": content_type}
    response = http.post("/v2/models/echo/infer", content=body, headers=headers)
    assert response.status_code == 415, response.text
    assert "application/json" in response.json()["error"]
    octets = http.post(
        "/v2/models/echo/infer", content=body, headers={"content-type": "application/octet-stream"}
    )
    assert octets.status_code == 200, octets.text


def test_health_server_and_model_metadata(tensor_gw):
    _, http = tensor_gw
    assert http.get("/v2/health/live").json() == {"live": True}
    assert http.get("/v2/health/ready").status_code == 200
    assert http.get("/v2").json()["name"] == "furnace-gateway"
    meta = http.get("/v2/models/slow").json()
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1]}]
    assert http.get("/v2/models/slow/ready").json() == {"name": "slow", "ready": True}
    for path in ("/v2/models/nope", "/v2/models/nope/ready"):
        missing = http.get(path)
        assert missing.status_code == 404
        assert set(missing.json()) == {"error"}
    unknown = http.post("/v2/models/nope/infer", json=_echo_body())
    assert unknown.status_code == 404


@pytest.mark.parametrize(
    "tensor",
    [
        {"name": "x", "datatype": "FP32", "shape": [3], "data": [1.0, 2.0]},  # length vs shape
        {"name": "x", "datatype": "FP33", "shape": [1], "data": [1.0]},  # unknown datatype
        {"name": "x", "datatype": "INT32", "shape": [1], "data": [1]},  # not the model's
        {"name": "x", "datatype": "FP32", "shape": [1], "data": ["one"]},  # not a number
        {"name": "y", "datatype": "FP32", "shape": [1], "data": [1.0]},  # unknown input
        {"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [1.0]},  # rank
    ],
)
def test_bad_tensors_are_400_before_any_worker(tensor_gw, tensor):
    gw, http = tensor_gw
    worker = next(iter(gw.state.fleet.models["slow"].workers.values()))
    response = http.post("/v2/models/slow/infer", json={"inputs": [tensor]})
    assert response.status_code == 400, response.text
    assert isinstance(response.json()["error"], str)
    assert worker.outstanding == 0


def test_a_missing_input_is_400(tensor_gw):
    _, http = tensor_gw
    body = _echo_body()
    body["inputs"] = body["inputs"][1:]
    response = http.post("/v2/models/echo/infer", json=body)
    assert response.status_code == 400
    assert "missing in_bool" in response.json()["error"]


def test_the_llm_routes_name_the_v2_route(tensor_gw):
    _, http = tensor_gw
    response = http.post("/v1/completions", json={"model": "echo", "prompt": "x"})
    assert response.status_code == 400
    assert "/v2/models/echo/infer" in response.json()["error"]["message"]


def test_a_client_that_leaves_cancels_the_call(tensor_gw):
    gw, http = tensor_gw
    worker = next(iter(gw.state.fleet.models["slow"].workers.values()))
    x = {"name": "x", "datatype": "FP32", "shape": [1], "data": [20.0]}
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v2/models/slow/infer", json={"inputs": [x]}, timeout=1.0)
    wait_until(lambda: worker.outstanding == 0, "the call to be cancelled")


def test_a_worker_killed_mid_request_is_503(gateway_with, tmp_path):
    server = KServeServer(tmp_path / "server.log")
    try:
        gw = gateway_with(models=_models(server.address))
        with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
            wait_until(lambda: http.get("/v2/models/slow/ready").status_code == 200, "ready")
            worker = next(iter(gw.state.fleet.models["slow"].workers.values()))
            x = {"name": "x", "datatype": "FP32", "shape": [1], "data": [20.0]}
            answer = {}

            def call():
                answer["r"] = http.post("/v2/models/slow/infer", json={"inputs": [x]})

            thread = threading.Thread(target=call)
            thread.start()
            wait_until(lambda: worker.outstanding == 1, "the call to reach the worker")
            server.process.kill()
            thread.join(HANG_GUARD)
            assert answer["r"].status_code == 503, answer["r"].text
            assert set(answer["r"].json()) == {"error"}
    finally:
        server.stop()


def test_the_binary_tensor_extension_both_ways(tensor_gw):
    import struct

    import orjson

    _, http = tensor_gw
    fp32 = struct.pack("<3f", 0.25, -1.5, 2.0**100)
    text = b"".join(struct.pack("<I", len(s)) + s for s in (b"ab", b"", "é".encode()))
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "in_fp32",
                    "datatype": "FP32",
                    "shape": [3],
                    "parameters": {"binary_data_size": len(fp32)},
                },
                {"name": "in_int64", "datatype": "INT64", "shape": [1], "data": [2**63 - 1]},
                {
                    "name": "in_bytes",
                    "datatype": "BYTES",
                    "shape": [3],
                    "parameters": {"binary_data_size": len(text)},
                },
            ],
            "outputs": [
                {"name": "in_fp32", "parameters": {"binary_data": True}},
                {"name": "in_int64"},
                {"name": "in_bytes"},
            ],
        }
    )
    # the echo model wants every datatype: the others as JSON
    body = orjson.loads(header)
    for datatype, values in EDGE_VALUES.items():
        if datatype not in ("FP32", "INT64", "BYTES"):
            name = f"in_{datatype.lower()}"
            body["inputs"].append(
                {"name": name, "datatype": datatype, "shape": [3], "data": values}
            )
    header = orjson.dumps(body)
    response = http.post(
        "/v2/models/echo/infer",
        content=header + fp32 + text,
        headers={"inference-header-content-length": str(len(header))},
    )
    assert response.status_code == 200, response.text
    size = int(response.headers["inference-header-content-length"])
    answer = orjson.loads(response.content[:size])
    outputs = {o["name"]: o for o in answer["outputs"]}
    assert outputs["in_fp32"]["parameters"]["binary_data_size"] == len(fp32)
    assert "data" not in outputs["in_fp32"]
    assert response.content[size:] == fp32
    assert outputs["in_int64"]["data"] == [2**63 - 1]
    assert outputs["in_bytes"]["data"] == ["ab", "", "é"]


def test_binary_data_that_does_not_fit_is_400(tensor_gw):
    import orjson

    _, http = tensor_gw
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "FP32",
                    "shape": [2],
                    "parameters": {"binary_data_size": 4},
                }
            ]
        }
    )
    response = http.post(
        "/v2/models/slow/infer",
        content=header + b"\0\0\0\0",
        headers={"inference-header-content-length": str(len(header))},
    )
    assert response.status_code == 400, response.text
    assert "do not hold FP32" in response.json()["error"]


def test_keys_and_allow_lists_cover_v2_but_its_health(gateway_with, kserve):
    from tests.support.keys import bearer, keyed, new_key

    models = [
        {"name": name, "kind": "tensor", "workers": [kserve.address]} for name in ("echo", "slow")
    ]
    key_a, key_b = new_key("a"), new_key("b")
    teams = {"a": {"models": ["slow"]}, "b": {"models": ["echo"]}}
    gw = gateway_with(**keyed(teams, {key_a: "a", key_b: "b"}, models=models))
    x = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [0.0]}]}
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
        assert http.get("/v2/health/live").status_code == 200
        assert http.post("/v2/models/slow/infer", json=x).status_code == 401
        assert http.get("/v2/models/slow").status_code == 401
        wait_until(
            lambda: http.get("/v2/models/slow/ready", headers=bearer(key_a)).status_code == 200,
            "slow ready",
        )
        ok = http.post("/v2/models/slow/infer", json=x, headers=bearer(key_a))
        assert ok.status_code == 200, ok.text
        hidden = http.post("/v2/models/slow/infer", json=x, headers=bearer(key_b))
        assert hidden.status_code == 404
        assert http.get("/v2/models/slow", headers=bearer(key_b)).status_code == 404


def test_metadata_caches_only_listed_versions_and_counts_against_team_limits(gateway_with, kserve):
    from tests.support.keys import bearer, keyed, new_key

    models = [{"name": "slow", "kind": "tensor", "workers": [kserve.address]}]
    key = new_key("a")
    teams = {"a": {"models": ["slow"], "requests_per_minute": 6}}
    gw = gateway_with(**keyed(teams, {key: "a"}, models=models))
    upstream = next(iter(gw.state.fleet.models["slow"].workers.values())).upstream
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD, headers=bearer(key)) as http:
        assert http.get("/v2/models/slow").status_code == 200
        # versions the worker does not list (KServe's lists none): asked, never kept
        for i in range(4):
            answer = http.get(f"/v2/models/slow/versions/{'v' * 2_000}{i}")
            assert answer.status_code in (200, 404), answer.text
        assert set(upstream._metadata) == {""}
        # every metadata call is one of the team's requests per minute
        answer = http.get("/v2/models/slow")
        assert answer.status_code == 200, answer.text
        limited = http.get("/v2/models/slow")
        assert limited.status_code == 429, limited.text
        assert set(limited.json()) == {"error"}


def _counter(text: str, name: str, model: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("model") == model:
                return sample.value
    return 0.0


def test_tensor_bytes_in_and_out_are_counted_once_per_request(gateway_with, kserve):
    gw = gateway_with(models=_models(kserve.address), admin_port=0)
    assert gw.admin_url is not None
    names = (
        "furnace_gateway_tensor_bytes_received_total",
        "furnace_gateway_tensor_bytes_sent_total",
    )
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
        wait_until(lambda: http.get("/v2/models/echo/ready").status_code == 200, "echo ready")
        before = httpx.get(gw.admin_url + "/metrics", timeout=HANG_GUARD).text
        body = orjson.dumps(_echo_body())
        response = http.post(
            "/v2/models/echo/infer", content=body, headers={"content-type": "application/json"}
        )
        assert response.status_code == 200, response.text
        bad = http.post(  # a 400 counts too
            "/v2/models/echo/infer", content=b"{}", headers={"content-type": "application/json"}
        )
        assert bad.status_code == 400
        after = httpx.get(gw.admin_url + "/metrics", timeout=HANG_GUARD).text
    received, sent = (_counter(after, n, "echo") - _counter(before, n, "echo") for n in names)
    assert received == len(body) + 2
    assert sent == len(response.content) + len(bad.content)
