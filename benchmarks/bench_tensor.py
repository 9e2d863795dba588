"""Tensor requests through the gateway against the worker's gRPC directly.

Three processes: our tensor worker (`furnace-gateway worker --engine onnx`, the `tensor`
extra) serving y = x*2+1 on FP32 tensors of shape [batch, 4] (built on the spot with `onnx`),
a gateway in front of it (`furnace-gateway serve`, `kind: tensor`), and this client, which for
a small tensor (1 x 4) and a 4 MB one (262144 x 4) runs `--concurrency` requests at a time for
`--seconds`: as ModelInfer with raw contents to the worker, as KServe v2 REST JSON to the
gateway, and as REST with the binary tensor extension (raw bytes in and out) to the gateway.
Added latency is the gateway's median minus the direct median; most of it, for
big tensors, is JSON (a 4 MB FP32 tensor is a million numbers in text, both ways).

    .venv/bin/python -m benchmarks.bench_tensor [--quick]

prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import httpx
import orjson

from gateway.protocol.kserve_v2 import grpc_predict_v2_pb2 as pb
from gateway.protocol.kserve_v2 import grpc_predict_v2_pb2_grpc as pb_grpc
from gateway.protocol.tensors import Tensor, to_raw
from tests.support.onnx_models import affine_model
from tests.support.processes import free_port, listening

SIZES = {"small (1x4 FP32)": 1, "4 MB (262144x4 FP32)": 262144}


async def _run(call: object, concurrency: int, seconds: float) -> tuple[int, list[float]]:
    latencies: list[float] = []
    errors = 0
    end = time.perf_counter() + seconds

    async def loop() -> None:
        nonlocal errors
        while time.perf_counter() < end:
            start = time.perf_counter()
            ok = await call()  # type: ignore[operator]
            if ok:
                latencies.append(time.perf_counter() - start)
            else:
                errors += 1

    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return errors, latencies


async def measure(args: argparse.Namespace, gateway: str, worker: str) -> list[str]:
    rows = []
    options = [
        ("grpc.max_send_message_length", 64 << 20),
        ("grpc.max_receive_message_length", 64 << 20),
    ]
    async with httpx.AsyncClient(base_url=gateway, timeout=60) as http:
        channel = grpc.aio.insecure_channel(worker, options=options)
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for label, batch in SIZES.items():
            values = [float(i % 1000) for i in range(batch * 4)]
            body = orjson.dumps(
                {"inputs": [{"name": "x", "datatype": "FP32", "shape": [batch, 4], "data": values}]}
            )
            raw = to_raw(Tensor("x", "FP32", (batch, 4), values))
            message = pb.ModelInferRequest(model_name="affine")
            message.inputs.add(name="x", datatype="FP32", shape=[batch, 4])
            message.raw_input_contents.append(raw)

            async def via_gateway(body: bytes = body) -> bool:
                response = await http.post(
                    "/v2/models/affine/infer",
                    content=body,
                    headers={"content-type": "application/json"},
                )
                return response.status_code == 200

            binary_header = orjson.dumps(
                {
                    "inputs": [
                        {
                            "name": "x",
                            "datatype": "FP32",
                            "shape": [batch, 4],
                            "parameters": {"binary_data_size": len(raw)},
                        }
                    ],
                    "parameters": {"binary_data_output": True},
                }
            )
            binary_headers = {"inference-header-content-length": str(len(binary_header))}

            async def via_gateway_binary(
                body: bytes = binary_header + raw, headers: dict[str, str] = binary_headers
            ) -> bool:
                response = await http.post("/v2/models/affine/infer", content=body, headers=headers)
                return response.status_code == 200

            async def direct(message: pb.ModelInferRequest = message, raw: bytes = raw) -> bool:
                reply = await stub.ModelInfer(message, timeout=60)
                return len(reply.raw_output_contents[0]) == len(raw)

            paths = (
                ("worker gRPC, direct", direct),
                ("gateway REST, JSON", via_gateway),
                ("gateway REST, binary extension", via_gateway_binary),
            )
            for name, call in paths:
                await _run(call, args.concurrency, 0.5)  # warm-up
                errors, latencies = await _run(call, args.concurrency, args.seconds)
                rate = len(latencies) / args.seconds
                p50 = statistics.median(latencies) * 1000
                p99 = (
                    statistics.quantiles(latencies, n=100)[98] * 1000 if len(latencies) > 1 else p50
                )
                rows.append(
                    f"| {label} | {name} | {rate:,.0f} | {p50:.2f} | {p99:.2f} | {errors} |"
                )
        await channel.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--quick", action="store_true", help="1 s per row")
    args = parser.parse_args()
    if args.quick:
        args.seconds = 1.0
    with tempfile.TemporaryDirectory() as folder:
        model = affine_model(Path(folder) / "affine.onnx")
        worker_port, gateway_port = free_port(), free_port()
        config = Path(folder) / "config.yaml"
        config.write_text(
            f"host: 127.0.0.1\nport: {gateway_port}\nlog_level: warning\n"
            f"max_concurrent_requests: 256\nmax_body_bytes: 67108864\nmodels:\n"
            f"  - name: affine\n    kind: tensor\n    workers: ['127.0.0.1:{worker_port}']\n"
        )
        python = [sys.executable, "-m", "gateway"]
        worker = subprocess.Popen(
            [
                *python,
                "worker",
                "--engine",
                "onnx",
                "--host",
                "127.0.0.1",
                "--port",
                str(worker_port),
                "--model-path",
                str(model),
                "--model",
                "affine",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        gateway = subprocess.Popen(
            [*python, "serve", "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            end = time.monotonic() + 30
            while not (listening(worker_port) and listening(gateway_port)):
                if (
                    time.monotonic() > end
                    or worker.poll() is not None
                    or gateway.poll() is not None
                ):
                    raise SystemExit("the worker or the gateway did not start")
                time.sleep(0.05)
            time.sleep(1.0)  # the gateway's first health check
            rows = asyncio.run(
                measure(args, f"http://127.0.0.1:{gateway_port}", f"127.0.0.1:{worker_port}")
            )
        finally:
            for process in (gateway, worker):
                process.terminate()
                process.wait(30)
    print(f"concurrency {args.concurrency}, {args.seconds:g} s per row\n")
    print("| tensor | path | requests/s | p50 ms | p99 ms | errors |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
