"""The KServe v2 gRPC upstream against a real third-party server: KServe's own Python model
server (tests/support/kserve_model.py), started once for this module."""

import asyncio

import pytest

from gateway.protocol import errors
from gateway.protocol.inference import InferRequest
from gateway.protocol.tensors import Tensor, tensor_from_json
from gateway.upstreams.kserve_grpc import KServeGrpcUpstream
from tests.support.kserve import EDGE_VALUES, KServeServer


@pytest.fixture(scope="module")
def kserve(tmp_path_factory):
    server = KServeServer(tmp_path_factory.mktemp("kserve") / "server.log")
    yield server
    server.stop()


def _run(coroutine_function):
    async def main():
        return await coroutine_function()

    return asyncio.run(main())


def test_every_datatype_round_trips_exactly(kserve):
    inputs = [
        tensor_from_json(
            {"name": f"in_{d.lower()}", "datatype": d, "shape": [3], "data": v}, "inputs"
        )
        for d, v in EDGE_VALUES.items()
    ]

    async def call():
        upstream = KServeGrpcUpstream(kserve.address, "echo")
        try:
            await _wait_ready(upstream)
            return await upstream.infer(InferRequest("echo", "", inputs, id="r1"), 10.0)
        finally:
            await upstream.close()

    result = _run(call)
    assert result.model == "echo"
    by_name = {t.name: t for t in result.outputs}
    for datatype, values in EDGE_VALUES.items():
        out = by_name[f"in_{datatype.lower()}"].to_json()
        assert out["datatype"] == datatype
        assert out["shape"] == [3]
        assert out["data"] == values, datatype


def test_metadata_and_readiness(kserve):
    async def call():
        upstream = KServeGrpcUpstream(kserve.address, "slow")
        missing = KServeGrpcUpstream(kserve.address, "nope")
        try:
            await _wait_ready(upstream)
            meta = await upstream.model_metadata("", 5.0)
            again = await upstream.model_metadata("", 5.0)
            return meta, again, await missing.ready(5.0), await upstream.describe(5.0)
        finally:
            await upstream.close()
            await missing.close()

    meta, again, missing_ready, described = _run(call)
    assert meta is again  # cached
    assert meta.to_json()["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1]}]
    assert missing_ready is False
    assert [d.name for d in described] == ["slow"]


def test_an_unreachable_worker_never_started_the_call():
    async def call():
        from tests.support.processes import free_port

        upstream = KServeGrpcUpstream(f"127.0.0.1:{free_port()}", "echo")
        x = Tensor("x", "FP32", (1,), [1.0])
        try:
            await upstream.infer(InferRequest("echo", "", [x]), 5.0)
        finally:
            await upstream.close()

    with pytest.raises(errors.Unavailable) as caught:
        _run(call)
    assert caught.value.never_started


async def _wait_ready(upstream: KServeGrpcUpstream) -> None:
    for _ in range(300):
        try:
            if await upstream.ready(2.0):
                return
        except errors.GatewayError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError("the model never became ready")
