"""Spec: Claude Code, Anthropic's agent CLI (the real one, from npm: `bash
deploy/install-tools.sh` puts it in .tools/bin), runs against the gateway as against
Anthropic's API: `ANTHROPIC_BASE_URL` at the gateway, a team's key as its API key, a model
the gateway serves. What it sends on every request (inline system messages, a deferred
tool, `context_management`, adaptive thinking with an effort, its billing header) is
served, its answer comes back whole, and nothing is left behind.

The model is the demo engine with a context that holds Claude Code's prompt (its system
prompt and tools are some thousands of words, the demo's tokens): the demo answers the
user's words back, so the CLI prints them.
"""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path

from gateway.worker.demo import DEMO_MODEL
from tests.support.agents import agent_gateway, served
from tests.support.installed import tool
from tests.support.keys import new_key
from tests.support.requests import whole_input
from tests.support.waiting import HANG_GUARD


def claude_code(binary: str, home: Path, url: str, key: str, prompt: str, turns: int = 1) -> dict:
    """One `claude -p` run against the gateway at `url`; its JSON result."""
    env = {
        "HOME": str(home),
        "PATH": "/usr/bin:/bin",
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_API_KEY": key,
        "ANTHROPIC_MODEL": DEMO_MODEL,
        "ANTHROPIC_SMALL_FAST_MODEL": DEMO_MODEL,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": DEMO_MODEL,
        # the default (32,000 and up) is more than this model's answers may take
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "256",
        # nothing but the gateway is reachable from the tests
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        # a refusal is answered at once (it retries a 401 for minutes by default)
        "CLAUDE_CODE_MAX_RETRIES": "0",
    }
    done = subprocess.run(
        [binary, "-p", prompt, "--output-format", "json", "--max-turns", str(turns)],
        capture_output=True,
        text=True,
        env=env,
        cwd=home,
        timeout=HANG_GUARD * 4,
    )
    assert done.stdout, done.stderr
    result: dict = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_claude_code_answers_through_the_gateway(gateway_with, serve_engines, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="furnace.access")
    binary = tool("claude")
    key = new_key("agents")
    gw = agent_gateway(gateway_with, serve_engines, key)
    result = claude_code(binary, tmp_path, gw.url, key, "hello through the gateway")
    assert result["is_error"] is False, result
    assert "hello through the gateway" in result["result"], result
    # its whole prompt reached the model (what the engine's cache held counted apart)
    assert whole_input(result["usage"]) > 1000
    # every request it made (its answer's, and those it makes besides) was served
    served(caplog)


def test_claude_code_runs_the_tool_the_model_calls_and_sends_its_result_back(
    gateway_with, serve_engines, tmp_path, caplog
):
    """An agent's turn: the demo calls each tool named in the user's words (here Claude
    Code's `Read`, with its schema's minimal input, an empty path); Claude Code runs it
    (reading its working directory fails) and sends the `tool_result` back with
    `is_error`, which the demo then echoes."""
    caplog.set_level(logging.INFO, logger="furnace.access")
    binary = tool("claude")
    gw = agent_gateway(gateway_with, serve_engines)
    result = claude_code(binary, tmp_path, gw.url, "unused", "Read", turns=3)
    assert result["is_error"] is False and result["num_turns"] == 2, result
    assert result["result"].startswith("Error: EISDIR"), result
    served(caplog, requests=2)


def test_claude_code_with_a_wrong_key_is_told_so(gateway_with, serve_engines, tmp_path):
    binary = tool("claude")
    gw = agent_gateway(gateway_with, serve_engines, new_key("agents"))
    result = claude_code(binary, tmp_path, gw.url, new_key("nobody"), "hello")
    assert result["is_error"] is True
    assert result.get("api_error_status") == 401, result
