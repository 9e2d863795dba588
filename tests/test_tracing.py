"""Tracing: the client's trace continues through the gateway to the worker, the
request's span ends with the GenAI usage attributes (the prefix cache's reads
among them); off, OpenTelemetry is not even imported."""

import subprocess
import sys
from typing import Any

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from gateway.config import ModelConfig
from gateway.worker.tensor.demo import DEMO_TENSOR_MODEL, DemoTensorEngine
from tests.support.requests import user
from tests.support.scripted_worker import script
from tests.support.servers import DEMO_MODEL
from tests.support.tensor_workers import RecordingServicer, TensorWorkers
from tests.support.waiting import HANG_GUARD, wait_until

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return exporter


def test_request_and_engine_spans_continue_the_clients_trace(gateway_with, workers, spans):
    gw = gateway_with(tracing=True)
    response = httpx.post(
        gw.url + "/v1/completions",
        json={"model": "scripted", "prompt": script(texts=2)},
        headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "x-request-id": "traced-1"},
        timeout=HANG_GUARD,
    )
    assert response.status_code == 200
    wait_until(lambda: len(spans.get_finished_spans()) >= 2, "both spans")
    by_kind = {s.kind: s for s in spans.get_finished_spans()}
    server, client = by_kind[SpanKind.SERVER], by_kind[SpanKind.CLIENT]
    assert format(server.context.trace_id, "032x") == TRACE_ID
    assert format(server.parent.span_id, "016x") == CLIENT_SPAN
    assert client.parent.span_id == server.context.span_id
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["gen_ai.usage.output_tokens"] == 2
    assert server.attributes["furnace.request_id"] == "traced-1"
    assert client.attributes["furnace.worker"] == workers.scripted.address
    sent = workers.scripted.metadata["traced-1"]["traceparent"]
    assert sent == f"00-{TRACE_ID}-{format(client.context.span_id, '016x')}-01"


def test_the_request_span_has_the_prompt_tokens_the_engines_cache_held(
    gateway_with: Any, spans: InMemorySpanExporter
) -> None:
    """The demo worker's prefix cache holds a chat's blocks the second time it is asked
    (tests/test_cached_tokens.py): 37 of its 40 prompt tokens, on the second span only,
    beside `gen_ai.usage.input_tokens` that counts them too (OTel's GenAI conventions)."""
    gw = gateway_with(tracing=True)
    body = {"model": DEMO_MODEL, "messages": user(" ".join(["span"] * 40)), "max_tokens": 2}
    spans.clear()
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
        for i in range(2):
            headers = {"x-request-id": f"cached-{i}"}
            assert http.post("/v1/chat/completions", json=body, headers=headers).is_success

    def servers() -> dict[str, Any]:
        return {
            s.attributes["furnace.request_id"]: s.attributes
            for s in spans.get_finished_spans()
            if s.kind is SpanKind.SERVER
        }

    wait_until(lambda: len(servers()) == 2, "both request spans")
    usage = [
        (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.cache_read.input_tokens"])
        for _, a in sorted(servers().items())
    ]
    assert usage == [(40, 0), (40, 37)]


def test_off_means_not_imported():
    code = (
        "import sys; from gateway.lifecycle import Gateway; from gateway.config import Config;"
        "Gateway(Config()); print('opentelemetry' in ' '.join(sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def test_tensor_requests_open_the_same_spans(gateway_with, server_loop, spans):
    tensor = TensorWorkers(server_loop)
    servicer = RecordingServicer(DemoTensorEngine())
    try:
        address = tensor.start(servicer=servicer)
        model = ModelConfig(
            DEMO_TENSOR_MODEL, kind="tensor", workers=(address,), upstream="kserve-grpc"
        )
        gw = gateway_with(tracing=True, models=(model,))
        with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
            ready = f"/v2/models/{DEMO_TENSOR_MODEL}/ready"
            wait_until(lambda: http.get(ready).status_code == 200, "tensor model ready")
            spans.clear()
            response = http.post(
                f"/v2/models/{DEMO_TENSOR_MODEL}/infer",
                json={"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1, 2]}]},
                headers={
                    "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01",
                    "x-request-id": "tensor-traced-1",
                },
            )
        assert response.status_code == 200, response.text
        wait_until(lambda: len(spans.get_finished_spans()) >= 2, "both spans")
        by_kind = {s.kind: s for s in spans.get_finished_spans()}
        server, client = by_kind[SpanKind.SERVER], by_kind[SpanKind.CLIENT]
        assert client.name == "inference.GRPCInferenceService/ModelInfer"
        assert format(server.context.trace_id, "032x") == TRACE_ID
        assert format(server.parent.span_id, "016x") == CLIENT_SPAN
        assert client.parent.span_id == server.context.span_id
        assert server.attributes["http.response.status_code"] == 200
        assert server.attributes["gen_ai.request.model"] == DEMO_TENSOR_MODEL
        assert server.attributes["furnace.request_id"] == "tensor-traced-1"
        sent = servicer.metadata["tensor-traced-1"]["traceparent"]
        assert sent == f"00-{TRACE_ID}-{format(client.context.span_id, '016x')}-01"
    finally:
        tensor.stop()


def test_remote_mcp_steps_have_spans_of_their_own(gateway_with, spans, mcp_url):
    prefix = mcp_url.removesuffix("mcp")
    gw = gateway_with(tracing=True, mcp_allowed_urls=(prefix,))
    spans.clear()
    tool = {
        "type": "mcp",
        "server_label": "spec",
        "server_url": mcp_url,
        "require_approval": "never",
    }
    body = {"model": DEMO_MODEL, "input": "please lookup", "tools": [tool]}
    response = httpx.post(gw.url + "/v1/responses", json=body, timeout=HANG_GUARD)
    assert response.status_code == 200, response.text
    wait_until(lambda: len(spans.get_finished_spans()) >= 4, "the request's spans")
    by_name = {s.name: s for s in spans.get_finished_spans()}
    call = by_name["execute_tool lookup"]
    assert call.kind == SpanKind.CLIENT
    assert call.attributes["gen_ai.operation.name"] == "execute_tool"
    assert call.attributes["gen_ai.tool.name"] == "lookup"
    assert call.attributes["furnace.mcp.server"] == prefix
    listing = by_name["mcp tools/list"]
    assert listing.attributes["furnace.mcp.step"] == "list"
    server = next(s for s in spans.get_finished_spans() if s.kind == SpanKind.SERVER)
    assert call.context.trace_id == listing.context.trace_id == server.context.trace_id
