"""What the LoRA adapter specs share (tests/test_lora_adapters.py against vLLM's HTTP
server, tests/test_lora_adapters_worker.py against our worker): the base's name, the
prompt, a greedy completion through the gateway, and the check that a load the workers
refuse is the operator's 500 and nothing against the worker."""

from __future__ import annotations

import openai
import pytest

from gateway.fleet.adapters import AdapterPool
from tests.support.clients import openai_sdk
from tests.support.servers import Gateway

BASE = "tiny-base"
PROMPT = "the quick brown fox"


def ask(sdk: openai.OpenAI, model: str) -> str:
    """The gateway's greedy completion of `PROMPT` by `model` (the answer names it)."""
    answer = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert answer.model == model
    return answer.choices[0].text


def refused_load(gateway: Gateway, adapter: str) -> AdapterPool:
    """Asks `adapter`, whose load the workers refuse: a 500 `engine_error`, the base still
    served, the load counted failed and nothing counted against the worker. Its pool."""
    with openai_sdk(gateway.url) as sdk:
        with pytest.raises(openai.InternalServerError) as refused:
            ask(sdk, adapter)
        assert refused.value.code == "engine_error"
        assert ask(sdk, BASE)  # the worker serves on: a load is not a call that failed
    pool = gateway.state.fleet.models[adapter]
    assert isinstance(pool, AdapterPool)
    assert pool.loads_total["failed"] >= 1 and pool.loads_total["loaded"] == 0
    worker = next(iter(pool.workers.values()))
    assert worker.consecutive_failures == 0 and worker.state == "healthy"
    return pool
