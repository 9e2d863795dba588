"""What the specs of the real agent CLIs (Claude Code, Codex) share: a gateway whose
model is the demo with a context that holds an agent's prompt (its system prompt and
tools are thousands of words, the demo's tokens), open or with one team's key, and the
check that every request the agent made was served."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from gateway.config import ModelConfig
from gateway.worker.demo import DEMO_MODEL, DemoEngine
from tests.support.keys import keyed
from tests.support.metrics import access_lines
from tests.support.servers import Gateway

#: An agent's prompt, in the demo's words, fits in this with room for the answer.
CONTEXT = 200_000


def agent_gateway(
    gateway_with: Callable[..., Gateway],
    serve_engines: Callable[..., Any],
    key: str | None = None,
) -> Gateway:
    """A gateway serving the demo (`DEMO_MODEL`) with `CONTEXT`; with `key`, keyed, the
    key the team "agents"'s."""
    (worker,) = serve_engines(DemoEngine(DEMO_MODEL, max_context=CONTEXT))
    keys = keyed({"agents": {}}, {key: "agents"}) if key is not None else {}
    return gateway_with(models=(ModelConfig(DEMO_MODEL, workers=(worker.address,)),), **keys)


def served(caplog: pytest.LogCaptureFixture, requests: int | None = None) -> None:
    """Every request the access log saw was answered 200 (`requests` of them, when
    given; at least one)."""
    lines = access_lines(caplog)
    assert lines and all(line["status"] == 200 for line in lines), lines
    assert requests is None or len(lines) == requests, lines
