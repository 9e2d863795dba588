"""vLLM's replay socket against a real vLLM OpenAI HTTP server (CPU build, the tiny
model) that publishes its KV events over ZMQ with a `replay_endpoint`: a gateway started
after the engine cached a prompt learns those blocks from the replay, before any
request of its own, and routes the prompt's prefix as a hit. Without the replay a
subscriber learns only blocks stored after it connected (tests/test_kv_routing_vllm.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from gateway.config import ModelConfig, RoutingConfig
from tests.support.processes import free_port
from tests.support.servers import Gateway
from tests.support.vllm import kv_events_args, start_http_server
from tests.support.waiting import HANG_GUARD, wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

MODEL = "tiny-kv-replay"


def test_a_gateway_started_late_learns_the_engines_blocks_from_its_replay(
    vllm_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    gateway_with: Callable[..., Gateway],
) -> None:
    events, replay = free_port(), free_port()
    logs = tmp_path_factory.mktemp("vllm-kv-replay")
    extra = kv_events_args(events, replay)
    server = start_http_server(vllm_model, logs, MODEL, extra)
    try:
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
        router = gw.state.fleet.models[MODEL].router
        assert router is not None
        index, subscriber = router.index, router.zmq[url]
        wait_until(lambda: bool(index.holders), "the engine's earlier blocks, replayed", 60)
        assert subscriber.replays >= 1 and subscriber.replayed >= 1
        assert subscriber.malformed == 0
        assert router.states[url] == "events"

        body["prompt"] = f"{document} again"
        response = httpx.post(f"{gw.url}/v1/completions", json=body, timeout=HANG_GUARD * 4)
        assert response.status_code == 200, response.text
        assert router.last.policy == "kv_aware"
        assert router.last.cache_hit_blocks >= 1  # the blocks of the request made before
    finally:
        server.stop()
