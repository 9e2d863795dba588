"""Specs: Anthropic's MCP connector (`mcp_servers`, and their `mcp_toolset`s in `tools`)
against a real MCP server (tests/support/mcp_server.py) and the demo worker, through the
official `anthropic` SDK's beta client. The demo calls a tool whose name is a word of the
last message, with the minimal instance of its schema: "please lookup" calls `lookup`
with `{"key": ""}`, and the next turn echoes the server's answer. Anthropic asks no
approval: the answer holds the call (`mcp_tool_use`), its result (`mcp_tool_result`) and
the text after it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import pytest

from tests.support.mcp_server import TOKEN
from tests.support.servers import DEMO_MODEL, Gateway
from tests.support.waiting import HANG_GUARD

OUTPUT = "value of ''"
BETA = "mcp-client-2025-11-20"


@pytest.fixture
def mcp_gateway(gateway_with: Callable[..., Gateway], mcp_url: str) -> Gateway:
    return gateway_with(mcp_allowed_urls=(mcp_url.removesuffix("mcp"),), mcp_timeout=5.0)


@pytest.fixture
def sdk(mcp_gateway: Gateway) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(
        base_url=mcp_gateway.url, api_key="unused", max_retries=0, timeout=HANG_GUARD
    ) as client:
        yield client


def _server(url: str, **more: Any) -> dict[str, Any]:
    return {"type": "url", "url": url, "name": "spec", **more}


def _ask(sdk: anthropic.Anthropic, text: str, servers: list[Any], tools: Any = ()) -> Any:
    return sdk.beta.messages.create(
        model=DEMO_MODEL,
        max_tokens=64,
        messages=[{"role": "user", "content": text}],
        mcp_servers=servers,
        tools=list(tools),
        betas=[BETA],
    )


def test_a_call_runs_and_the_answer_holds_it_and_its_result(
    sdk: anthropic.Anthropic, mcp_url: str
) -> None:
    toolset = {"type": "mcp_toolset", "mcp_server_name": "spec"}
    message = _ask(sdk, "please lookup", [_server(mcp_url)], [toolset])
    assert [block.type for block in message.content] == [
        "mcp_tool_use",
        "mcp_tool_result",
        "text",
    ]
    use, result, text = message.content
    assert use.name == "lookup" and use.server_name == "spec" and use.input == {"key": ""}
    assert result.tool_use_id == use.id and result.is_error is False
    assert result.content[0].text == OUTPUT
    assert text.text == OUTPUT
    assert message.stop_reason == "end_turn"
    # two turns, each prompt counted: "please lookup", then it and the result (the
    # demo's prefix cache read part of the second: Anthropic's input is the rest)
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == 2 + 2 + len(OUTPUT.split())


def test_streamed_the_blocks_come_in_order(sdk: anthropic.Anthropic, mcp_url: str) -> None:
    with sdk.beta.messages.stream(
        model=DEMO_MODEL,
        max_tokens=64,
        messages=[{"role": "user", "content": "please lookup"}],
        mcp_servers=[_server(mcp_url)],
        betas=[BETA],
    ) as stream:
        final = stream.get_final_message()
    assert [block.type for block in final.content] == ["mcp_tool_use", "mcp_tool_result", "text"]
    assert final.content[0].input == {"key": ""}
    assert final.content[2].text == OUTPUT


def test_the_conversation_sent_back_is_read_whole(sdk: anthropic.Anthropic, mcp_url: str) -> None:
    first = _ask(sdk, "please lookup", [_server(mcp_url)])
    history: list[Any] = [
        {"role": "user", "content": "please lookup"},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": "say done"},
    ]
    second = sdk.beta.messages.create(
        model=DEMO_MODEL,
        max_tokens=64,
        messages=history,
        mcp_servers=[_server(mcp_url)],
        betas=[BETA],
    )
    assert [block.type for block in second.content] == ["text"]
    assert second.content[0].text == "say done"


def test_tools_turned_off_are_not_offered(sdk: anthropic.Anthropic, mcp_url: str) -> None:
    off = {
        "type": "mcp_toolset",
        "mcp_server_name": "spec",
        "configs": {"lookup": {"enabled": False}},
    }
    message = _ask(sdk, "please lookup", [_server(mcp_url)], [off])
    assert [block.type for block in message.content] == ["text"]  # nothing to call
    only = {
        "type": "mcp_toolset",
        "mcp_server_name": "spec",
        "default_config": {"enabled": False},
        "configs": {"lookup": {"enabled": True}},
    }
    message = _ask(sdk, "lookup or fail", [_server(mcp_url)], [only])
    assert [b.name for b in message.content if b.type == "mcp_tool_use"] == ["lookup"]


def test_the_authorization_token_reaches_the_server(sdk: anthropic.Anthropic, mcp_url: str) -> None:
    url = mcp_url + "?auth=1"
    message = _ask(sdk, "please lookup", [_server(url, authorization_token=TOKEN)])
    assert message.content[-1].text == OUTPUT
    with pytest.raises(anthropic.APIStatusError) as refused:
        _ask(sdk, "please lookup", [_server(url)])
    assert refused.value.status_code == 424


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"mcp_servers": [_server("http://169.254.169.254/mcp")]}, "mcp_servers[0].url"),
        ({"mcp_servers": [{"type": "stdio", "name": "x"}]}, "mcp_servers[0].type"),
        (
            {
                "mcp_servers": [_server("http://x/")],
                "tools": [{"type": "mcp_toolset", "mcp_server_name": "other"}],
            },
            "tools[0].mcp_server_name",
        ),
        ({"tools": [{"type": "mcp_toolset", "mcp_server_name": "x"}]}, "tools[0].mcp_server_name"),
        (
            {
                "mcp_servers": [_server("http://x/")],
                "tools": [
                    {
                        "type": "mcp_toolset",
                        "mcp_server_name": "spec",
                        "default_config": {"defer_loading": True},
                    }
                ],
            },
            "tools[0].default_config.defer_loading",
        ),
    ],
)
def test_a_bad_server_is_a_400_naming_it(
    mcp_gateway: Gateway, body: dict[str, Any], param: str
) -> None:
    request = {
        "model": DEMO_MODEL,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
        **body,
    }
    answer = httpx.post(f"{mcp_gateway.url}/v1/messages", json=request, timeout=HANG_GUARD)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert param in error["message"]


def test_count_tokens_lists_the_servers_tools_as_the_answer_would(
    mcp_gateway: Gateway, mcp_url: str
) -> None:
    body = {
        "model": DEMO_MODEL,
        "messages": [{"role": "user", "content": "please lookup"}],
        "mcp_servers": [_server(mcp_url)],
    }
    url = f"{mcp_gateway.url}/v1/messages/count_tokens"
    counted = httpx.post(url, json=body, timeout=HANG_GUARD)
    assert counted.status_code == 200, counted.text
    assert counted.json()["input_tokens"] > 0
    elsewhere = {**body, "mcp_servers": [_server("http://169.254.169.254/mcp")]}
    refused = httpx.post(url, json=elsewhere, timeout=HANG_GUARD)
    assert refused.status_code == 400
    assert "mcp_allowed_urls" in refused.json()["error"]["message"]
