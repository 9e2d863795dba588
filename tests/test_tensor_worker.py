"""Our own tensor worker (`furnace-gateway worker --engine onnx`) behind the gateway's KServe
v2 routes, serving ONNX models built on the spot."""

import httpx
import pytest

from gateway.config import ModelConfig
from tests.support.kserve import EDGE_VALUES
from tests.support.onnx_models import IDENTITY_TYPES, affine_model, identity_model
from tests.support.processes import free_port, running, wait_ready, worker_process
from tests.support.waiting import HANG_GUARD, wait_until


@pytest.fixture(scope="module")
def onnx_workers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("onnx")
    affine, identity = affine_model(folder / "affine.onnx"), identity_model(folder / "ident.onnx")
    ports = free_port(), free_port()
    with (
        worker_process(ports[0], "--engine", "onnx", "--model-path", str(affine)),
        worker_process(ports[1], "--engine", "onnx", "--model-path", str(identity)),
    ):
        yield tuple(f"127.0.0.1:{p}" for p in ports)


@pytest.fixture
def http(gateway_with, onnx_workers):
    models = (
        ModelConfig("affine", kind="tensor", workers=(onnx_workers[0],), upstream="kserve-grpc"),
        ModelConfig("ident", kind="tensor", workers=(onnx_workers[1],), upstream="kserve-grpc"),
    )
    gw = gateway_with(models=models)
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        for name in ("affine", "ident"):
            wait_until(lambda n=name: client.get(f"/v2/models/{n}/ready").status_code == 200, name)
        yield client


def test_the_affine_model_computes_through_the_gateway(http):
    meta = http.get("/v2/models/affine").json()
    assert meta["platform"] == "onnxruntime_onnx"
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    x = {"name": "x", "datatype": "FP32", "shape": [2, 4], "data": [[0, 1, 2, 3], [4, 5, 6, 7]]}
    response = http.post("/v2/models/affine/infer", json={"inputs": [x]})
    assert response.status_code == 200, response.text
    (y,) = response.json()["outputs"]
    assert (y["name"], y["shape"]) == ("y", [2, 4])
    assert y["data"] == [float(v * 2 + 1) for v in range(8)]


def test_the_identity_model_round_trips_each_datatype(http):
    inputs = [
        {"name": f"in_{d.lower()}", "datatype": d, "shape": [3], "data": EDGE_VALUES[d]}
        for d in IDENTITY_TYPES
    ]
    response = http.post("/v2/models/ident/infer", json={"inputs": inputs})
    assert response.status_code == 200, response.text
    outputs = {o["name"]: o for o in response.json()["outputs"]}
    for datatype in IDENTITY_TYPES:
        out = outputs[f"out_{datatype.lower()}"]
        assert (out["datatype"], out["data"]) == (datatype, EDGE_VALUES[datatype]), datatype


def test_a_version_the_worker_does_not_serve_is_a_404(http):
    """The worker serves version 1 (its metadata lists it); another is not found, as
    Triton answers, not served as version 1, nor said ready."""
    x = {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [0, 1, 2, 3]}
    assert http.get("/v2/models/affine").json()["versions"] == ["1"]
    served = http.post("/v2/models/affine/versions/1/infer", json={"inputs": [x]})
    assert served.status_code == 200, served.text
    assert served.json()["model_version"] == "1"
    for path in (
        "/v2/models/affine/versions/9/infer",
        "/v2/models/affine/versions/9",
        "/v2/models/affine/versions/9/ready",
    ):
        answer = http.post(path, json={"inputs": [x]}) if "infer" in path else http.get(path)
        assert answer.status_code == 404, answer.text
        assert set(answer.json()) == {"error"}
    ready = http.get("/v2/models/affine/versions/1/ready")
    assert ready.status_code == 200 and ready.json() == {"name": "affine", "ready": True}


def test_a_wrong_shape_is_400_before_the_worker(http):
    x = {"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}
    response = http.post("/v2/models/affine/infer", json={"inputs": [x]})
    assert response.status_code == 400
    assert "the model takes [-1, 4]" in response.json()["error"]


def test_the_demo_serves_a_tensor_model_next_to_the_llm():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with (
        running("demo", "--port", str(port)) as process,
        httpx.Client(timeout=HANG_GUARD) as client,
    ):
        wait_ready(url, process)
        wait_until(
            lambda: client.get(f"{url}/v2/models/furnace-demo-affine/ready").status_code == 200,
            "the demo tensor model",
        )
        x = {"name": "x", "datatype": "FP32", "shape": [4], "data": [0.5, 1, 2, -3]}
        response = client.post(f"{url}/v2/models/furnace-demo-affine/infer", json={"inputs": [x]})
        assert response.status_code == 200, response.text
        (y,) = response.json()["outputs"]
        assert (y["shape"], y["data"]) == ([4], [2.0, 3.0, 5.0, -5.0])
        llm = client.post(
            f"{url}/v1/completions", json={"model": "furnace-demo-affine", "prompt": "x"}
        )
        assert "/v2/models/furnace-demo-affine/infer" in llm.json()["error"]["message"]


def test_the_worker_answers_grpc_health_for_kubernetes_probes(onnx_workers):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(onnx_workers[0]) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=HANG_GUARD)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
