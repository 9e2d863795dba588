"""What a KV-routing gateway learns of a real vLLM engine (CPU build, the tiny model)
besides the blocks it stores while the gateway listens (tests/test_kv_routing_vllm.py):

- the blocks from before it listened: vLLM's OpenAI HTTP server publishes its KV events
  over ZMQ with a `replay_endpoint`; a gateway started after the engine cached a prompt
  learns those blocks from the replay, before any request of its own, and routes the
  prompt's prefix as a hit;
- its scheduler's load: our worker on `--engine vllm` forwards vLLM's scheduler
  statistics as load records, so the gateway's index sees the engine's running requests
  and KV-cache use while an answer streams, and sees it idle again after, without a KV
  event in between."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from gateway.config import ModelConfig, RoutingConfig
from gateway.protocol.kv_blocks import EngineLoad
from tests.support.processes import free_port
from tests.support.servers import Gateway
from tests.support.vllm import kv_events_args, start_http_server
from tests.support.vllm_worker import start_vllm_worker
from tests.support.waiting import HANG_GUARD, wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

MODEL = "tiny-kv"


def test_a_gateway_started_late_learns_the_engines_blocks_from_its_replay(
    vllm_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    gateway_with: Callable[..., Gateway],
) -> None:
    events, replay = free_port(), free_port()
    logs = tmp_path_factory.mktemp("vllm-kv-replay")
    extra = kv_events_args(events, replay)
    with start_http_server(vllm_model, logs, MODEL, extra) as server:
        url = f"http://127.0.0.1:{server.port}/v1"
        document = " ".join(f"line {i} of an early document," for i in range(20))
        body = {"model": MODEL, "prompt": f"{document} first", "max_tokens": 2}
        direct = httpx.post(f"{url}/completions", json=body, timeout=HANG_GUARD * 4)
        assert direct.status_code == 200, direct.text

        routing = RoutingConfig(
            kv_events=((url, f"tcp://127.0.0.1:{events}"),),
            kv_replay=((url, f"tcp://127.0.0.1:{replay}"),),
        )
        model = ModelConfig(
            MODEL, upstream="openai", tokenizer=str(vllm_model), workers=(url,), routing=routing
        )
        gw = gateway_with(models=(model,))
        router = gw.router(MODEL)
        index, subscriber = router.index, router.zmq[url]
        wait_until(lambda: bool(index.holders), "the engine's earlier blocks, replayed", 60)
        # a replay is counted once its end is read, after its batches are applied
        wait_until(lambda: subscriber.replays >= 1, "the replay's end")
        assert subscriber.replayed >= 1
        assert subscriber.malformed == 0
        assert router.states[url] == "events"

        body["prompt"] = f"{document} again"
        response = httpx.post(f"{gw.url}/v1/completions", json=body, timeout=HANG_GUARD * 4)
        assert response.status_code == 200, response.text
        assert router.last.policy == "kv_aware"
        assert router.last.cache_hit_blocks >= 1  # the blocks of the request made before


def test_the_vllm_worker_forwards_its_schedulers_load(
    vllm_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    gateway_with: Callable[..., Gateway],
) -> None:
    logs = tmp_path_factory.mktemp("vllm-worker-loads")
    options = kv_events_args()
    with start_vllm_worker(vllm_model, logs, *options, name=MODEL) as worker:
        address = f"127.0.0.1:{worker.port}"
        model = ModelConfig(
            MODEL, workers=(address,), tokenizer=str(vllm_model), routing=RoutingConfig()
        )
        gw = gateway_with(models=(model,))
        router = gw.router(MODEL)
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
