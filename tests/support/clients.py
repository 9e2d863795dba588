"""The official `openai` SDK's clients as the specs make them against a gateway: no
retries (a refusal is the answer under test) and the hang guard as the timeout."""

from __future__ import annotations

import openai

from tests.support.waiting import HANG_GUARD


def openai_sdk(url: str, key: str = "none") -> openai.OpenAI:
    """A client of the gateway at `url` with `key`; close it (`with`) when done."""
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=HANG_GUARD)


def async_openai_sdk(url: str, key: str = "none") -> openai.AsyncOpenAI:
    """The async client, likewise."""
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=HANG_GUARD)
