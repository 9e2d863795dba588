"""Tensor workers on the fleet, against our own tensor worker (the pure-Python demo model
behind the KServe v2 gRPC server, in-process): a dead worker beside a live one costs no
request, the drain lets a tensor call in flight finish and refuses new ones, and TLS."""

import asyncio

import httpx
import pytest

from gateway.config import ModelConfig, WorkerTLS
from gateway.protocol.tls import ServerTLS
from gateway.worker.tensor.demo import DEMO_TENSOR_MODEL
from tests.support.certs import CertificateAuthority
from tests.support.onnx_models import affine_model
from tests.support.processes import free_port, worker_process
from tests.support.tensor_workers import GatedEngine, TensorWorkers
from tests.support.waiting import HANG_GUARD, wait_until

INFER = f"/v2/models/{DEMO_TENSOR_MODEL}/infer"
READY = f"/v2/models/{DEMO_TENSOR_MODEL}/ready"
BODY = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [3], "data": [0, 1, 2]}]}


@pytest.fixture
def tensor_workers(server_loop):
    workers = TensorWorkers(server_loop)
    yield workers
    workers.stop()


def _model(*addresses: str) -> tuple[ModelConfig, ...]:
    return (
        ModelConfig(DEMO_TENSOR_MODEL, kind="tensor", workers=addresses, upstream="kserve-grpc"),
    )


def _workers(url: str) -> dict[str, dict]:
    body = httpx.get(url + "/admin/workers", timeout=HANG_GUARD).json()
    pool = next(m for m in body["models"] if m["name"] == DEMO_TENSOR_MODEL)
    return {w["address"]: w for w in pool["workers"]}


def test_a_dead_worker_costs_no_request_and_leaves_the_rotation(gateway_with, tensor_workers):
    live = tensor_workers.start()
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    gw = gateway_with(
        models=_model(dead, live), admin_port=0, eject_after_failures=2, retry_attempts=3
    )
    assert gw.admin_url is not None
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
        wait_until(lambda: http.get(READY).status_code == 200, "the model ready")
        for _ in range(10):
            response = http.post(INFER, json=BODY)
            assert response.status_code == 200, response.text
            assert response.json()["outputs"][0]["data"] == [1.0, 3.0, 5.0]
    # out of the rotation: ejected by failed calls, or found unreachable by its health check
    wait_until(
        lambda: _workers(gw.admin_url)[dead]["state"] in ("ejected", "not_serving"), "dead out"
    )
    assert _workers(gw.admin_url)[live]["state"] == "healthy"


def test_the_drain_lets_a_tensor_call_finish_and_refuses_new_ones(
    gateway_with, tensor_workers, server_loop
):
    engine = GatedEngine()
    gw = gateway_with(models=_model(tensor_workers.start(engine)))

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=gw.url, timeout=HANG_GUARD) as client:
            for _ in range(200):  # bounded: the model's metadata and readiness
                if (await client.get(READY)).status_code == 200:
                    break
                await asyncio.sleep(0.05)
            first = asyncio.create_task(client.post(INFER, json=BODY))
            await asyncio.to_thread(engine.started.wait, HANG_GUARD)
            drain = asyncio.run_coroutine_threadsafe(
                gw.state.inflight.drain(HANG_GUARD), server_loop.loop
            )
            for _ in range(200):  # bounded: the drain has shut the door
                if gw.state.inflight.draining:
                    break
                await asyncio.sleep(0.01)
            second = await client.post(INFER, json=BODY)
            engine.release.set()
            answer = await first
            await asyncio.wrap_future(drain)
            return answer, second

    answer, refused = asyncio.run(scenario())
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["data"] == [1.0, 3.0, 5.0]
    assert refused.status_code == 503, refused.text
    assert "error" in refused.json()


def test_our_tensor_worker_serves_mutual_tls(gateway_with, tensor_workers, tmp_path):
    ca = CertificateAuthority(tmp_path, "furnace-ca")
    worker = ca.issue("worker", dns=("localhost",), ips=("127.0.0.1",))
    gateway_cert = ca.issue("gateway", client=True)
    address = tensor_workers.start(tls=ServerTLS(worker.cert_file, worker.key_file, ca.ca_file))
    # the gateway's worker_tls reaches kserve-grpc channels: mutual TLS answers
    gw = gateway_with(
        models=_model(address),
        worker_tls=WorkerTLS(ca.ca_file, gateway_cert.cert_file, gateway_cert.key_file),
    )
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
        wait_until(lambda: http.get(READY).status_code == 200, "the model ready over TLS")
        response = http.post(INFER, json=BODY)
        assert response.status_code == 200, response.text
        assert response.json()["outputs"][0]["data"] == [1.0, 3.0, 5.0]
    # a gateway without TLS is refused: the worker never becomes ready
    plain = gateway_with(models=_model(address))
    with httpx.Client(base_url=plain.url, timeout=HANG_GUARD) as http:
        wait_until(lambda: http.get(READY).status_code == 503, "the worker refused")
        assert http.post(INFER, json=BODY).status_code == 503


def test_the_onnx_worker_command_serves_tls(gateway_with, tmp_path):
    ca = CertificateAuthority(tmp_path, "furnace-ca")
    worker = ca.issue("worker", dns=("localhost",), ips=("127.0.0.1",))
    model = affine_model(tmp_path / "affine.onnx")
    port = free_port()
    tls = ("--tls-cert", str(worker.cert_file), "--tls-key", str(worker.key_file))
    with worker_process(port, "--engine", "onnx", "--model-path", str(model), *tls):
        config = ModelConfig(
            "affine", kind="tensor", workers=(f"127.0.0.1:{port}",), upstream="kserve-grpc"
        )
        gw = gateway_with(models=(config,), worker_tls=WorkerTLS(ca_file=ca.ca_file))
        with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
            wait_until(lambda: http.get("/v2/models/affine/ready").status_code == 200, "ready")
            x = {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [0, 1, 2, 3]}
            response = http.post("/v2/models/affine/infer", json={"inputs": [x]})
            assert response.status_code == 200, response.text
            assert response.json()["outputs"][0]["data"] == [1.0, 3.0, 5.0, 7.0]
