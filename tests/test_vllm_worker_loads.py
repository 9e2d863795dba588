"""Our worker on `--engine vllm` (real vLLM, CPU build, the tiny model) with KV events:
besides its engine's blocks it forwards vLLM's scheduler statistics as load records,
so the gateway's index sees the engine's running requests and KV-cache use while an
answer streams and sees it idle again after, without a KV event in between."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from gateway.config import ModelConfig, RoutingConfig
from gateway.protocol.kv_blocks import EngineLoad
from tests.support.servers import Gateway
from tests.support.vllm import kv_events_args
from tests.support.vllm_worker import start_vllm_worker
from tests.support.waiting import HANG_GUARD, wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

MODEL = "tiny-loads"


def test_the_vllm_worker_forwards_its_schedulers_load(
    vllm_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    gateway_with: Callable[..., Gateway],
) -> None:
    logs = tmp_path_factory.mktemp("vllm-worker-loads")
    options = kv_events_args()
    worker = start_vllm_worker(vllm_model, logs, *options, name=MODEL)
    try:
        address = f"127.0.0.1:{worker.port}"
        model = ModelConfig(
            MODEL, workers=(address,), tokenizer=str(vllm_model), routing=RoutingConfig()
        )
        gw = gateway_with(models=(model,))
        router = gw.state.fleet.models[MODEL].router
        assert router is not None
        wait_until(lambda: router.states.get(address) == "events", "the worker's stream", 60)
        index = router.index

        def load() -> EngineLoad:
            kv = index.workers.get(address)
            return EngineLoad() if kv is None or kv.load is None else kv.load

        seen: list[EngineLoad] = []
        body = {
            "model": MODEL,
            "prompt": "a long answer, please:",
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        with (
            httpx.Client(base_url=gw.url, timeout=HANG_GUARD * 4) as http,
            http.stream("POST", "/v1/completions", json=body) as response,
        ):
            assert response.status_code == 200
            lines = response.iter_lines()
            for _ in lines:
                seen.append(load())
                if seen[-1].running >= 1:
                    break
            assert seen[-1].running >= 1, seen[-1]  # the engine's own count, mid-answer
            assert 0.0 < seen[-1].kv_usage <= 1.0
            for _ in lines:
                pass
        wait_until(lambda: load().running == 0, "the engine idle again in its load record", 60)
    finally:
        worker.stop()
