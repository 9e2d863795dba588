"""Spec: Codex CLI, OpenAI's agent CLI (the real one, from npm: `bash
deploy/install-tools.sh` puts it in .tools/bin), runs against the gateway's Responses API
as a custom provider (`wire_api = "responses"`), with a team's key as its API key. What it
sends on every request (its `client_metadata`, a `namespace` of function tools, its
history back with `store: false`, the reasoning's `include`) is served, and its answer
comes back whole. Its hosted `web_search` tool is left out by its config, as the docs tell
users (the gateway refuses it by name).

The model is the demo engine with a context that holds Codex's prompt: the demo calls
each tool named in the user's words and otherwise answers them back, so the CLI prints
them.
"""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path
from typing import Any

from gateway.worker.demo import DEMO_MODEL
from tests.support.agents import agent_gateway, served
from tests.support.installed import tool
from tests.support.keys import new_key
from tests.support.waiting import HANG_GUARD

#: The provider as docs/api/responses.md gives it (but the sandbox); `{url}` is the gateway's.
CONFIG = """\
model = "{model}"
model_provider = "furnace"
web_search = "disabled"
approval_policy = "never"
# no sandbox: its bubblewrap needs user namespaces, which a CI machine may not give; the
# only command run is the demo's empty one, in the test's own directory
sandbox_mode = "danger-full-access"

[model_providers.furnace]
name = "furnace-gateway"
base_url = "{url}/v1"
env_key = "FURNACE_API_KEY"
wire_api = "responses"
# a refusal is answered at once (it retries by default)
request_max_retries = 0
stream_max_retries = 0
"""


def codex(binary: str, home: Path, url: str, key: str, prompt: str) -> list[dict[str, Any]]:
    """One `codex exec --json` run against the gateway at `url`; its JSONL events."""
    (home / "config.toml").write_text(CONFIG.format(model=DEMO_MODEL, url=url))
    env = {"HOME": str(home), "CODEX_HOME": str(home), "PATH": "/usr/bin:/bin"}
    env["FURNACE_API_KEY"] = key
    done = subprocess.run(
        [binary, "exec", "--json", "--skip-git-repo-check", prompt],
        capture_output=True,
        text=True,
        env=env,
        cwd=home,
        stdin=subprocess.DEVNULL,
        timeout=HANG_GUARD * 4,
    )
    assert done.stdout, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def items(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The completed items of one kind (`agent_message`, `command_execution`, ...)."""
    done = (e["item"] for e in events if e["type"] == "item.completed")
    return [item for item in done if item["type"] == kind]


def test_codex_answers_through_the_gateway(gateway_with, serve_engines, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="furnace.access")
    binary = tool("codex")
    key = new_key("agents")
    gw = agent_gateway(gateway_with, serve_engines, key)
    events = codex(binary, tmp_path, gw.url, key, "hello through the gateway")
    assert [m["text"] for m in items(events, "agent_message")] == ["hello through the gateway"]
    (turn,) = [e for e in events if e["type"] == "turn.completed"]
    assert turn["usage"]["input_tokens"] > 1000  # its whole prompt reached the model
    # every request it made was served
    served(caplog)


def test_codex_runs_the_command_the_model_calls_and_sends_its_output_back(
    gateway_with, serve_engines, tmp_path, caplog
):
    """An agent's turn: the demo calls Codex's `exec_command` (its schema's minimal input,
    an empty command); Codex runs it and sends the output back,
    its history with it, which the demo then echoes."""
    caplog.set_level(logging.INFO, logger="furnace.access")
    binary = tool("codex")
    gw = agent_gateway(gateway_with, serve_engines)
    events = codex(binary, tmp_path, gw.url, "unused", "exec_command")
    (command,) = items(events, "command_execution")
    assert command["status"] == "completed" and command["exit_code"] == 0, command
    (answer,) = items(events, "agent_message")
    assert "Process exited with code 0" in answer["text"], answer
    served(caplog, requests=2)


def test_codex_runs_the_namespaced_tool_the_model_calls(
    gateway_with, serve_engines, tmp_path, caplog
):
    """The demo calls `multi_agent_v1__wait_agent`, the flat name of Codex's `wait_agent`
    in its `multi_agent_v1` namespace: the call reaches Codex by its own name and
    namespace, Codex runs it (no agent to wait for: its error is the output) and sends the
    call back with its namespace, which is served."""
    caplog.set_level(logging.INFO, logger="furnace.access")
    binary = tool("codex")
    gw = agent_gateway(gateway_with, serve_engines)
    events = codex(binary, tmp_path, gw.url, "unused", "multi_agent_v1__wait_agent")
    (answer,) = items(events, "agent_message")
    assert answer["text"] and answer["text"] != "multi_agent_v1__wait_agent", answer
    served(caplog, requests=2)


def test_codex_with_a_wrong_key_is_told_so(gateway_with, serve_engines, tmp_path):
    binary = tool("codex")
    gw = agent_gateway(gateway_with, serve_engines, new_key("agents"))
    events = codex(binary, tmp_path, gw.url, new_key("nobody"), "hello")
    failed = [e for e in events if e["type"] == "turn.failed"]
    assert failed and "401" in json.dumps(failed), events
