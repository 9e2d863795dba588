"""Specs: the Responses API's remote MCP tools (`{"type": "mcp", ...}`) against a real MCP
server (the `mcp` SDK's, Streamable HTTP, in a process of its own:
tests/support/mcp_server.py) and the demo worker, through the official `openai` SDK.

The demo calls a tool whose name is a word of the last message and echoes the last
message otherwise (`gateway.worker.demo`), with the minimal instance of the tool's schema
as its arguments: "please lookup" calls the server's `lookup` with `{"key": ""}`, and the
next turn echoes the tool's output, "value of ''". So an answer whose calls need no
approval holds the listing, the call with its output, and the message that echoes it; one
whose calls need approval stops at the approval request, and the next request's approval
runs the call."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.clients import openai_sdk
from tests.support.mcp_server import TOKEN
from tests.support.metrics import scrape, value
from tests.support.servers import DEMO_MODEL, Gateway
from tests.support.waiting import HANG_GUARD, wait_until

OUTPUT = "value of ''"


@pytest.fixture
def mcp_gateway(gateway_with: Callable[..., Gateway], mcp_url: str) -> Gateway:
    root = mcp_url.removesuffix("mcp")
    return gateway_with(mcp_allowed_urls=(root,), mcp_timeout=5.0)


@pytest.fixture
def sdk(mcp_gateway: Gateway) -> Iterator[openai.OpenAI]:
    with openai_sdk(mcp_gateway.url) as client:
        yield client


def _tool(url: str, **more: Any) -> dict[str, Any]:
    return {"type": "mcp", "server_label": "spec", "server_url": url, **more}


def _types(response: Any) -> list[str]:
    return [item.type for item in response.output]


def test_a_call_that_needs_no_approval_runs_and_the_model_reads_its_output(
    sdk: openai.OpenAI, mcp_url: str
) -> None:
    tool = _tool(mcp_url, require_approval="never")
    response = sdk.responses.create(model=DEMO_MODEL, input="please lookup", tools=[tool])
    assert _types(response) == ["mcp_list_tools", "mcp_call", "message"]
    listing, call, _ = response.output
    assert listing.server_label == "spec"
    assert {t.name for t in listing.tools} == {"lookup", "fail", "pause", "stall"}
    assert call.name == "lookup" and call.server_label == "spec"
    assert call.arguments == '{"key":""}' and call.output == OUTPUT and call.error is None
    assert response.output_text == OUTPUT
    assert response.status == "completed"
    # two turns, each prompt counted: "please lookup" (2 words), then it and the output
    assert response.usage is not None
    assert response.usage.input_tokens == 2 + (2 + len(OUTPUT.split()))
    assert response.usage.output_tokens == len(OUTPUT.split()) + 2  # the call's 2 pieces
    shown = response.tools[0]
    assert shown.type == "mcp" and shown.server_url == mcp_url and shown.headers is None


def test_the_steps_are_counted_by_the_allowed_prefix(
    sdk: openai.OpenAI, mcp_gateway: Gateway, mcp_url: str
) -> None:
    prefix = mcp_url.removesuffix("mcp")
    tool = _tool(mcp_url, require_approval="never")
    sdk.responses.create(model=DEMO_MODEL, input="please lookup", tools=[tool])
    failing = _tool(mcp_url, require_approval="never", allowed_tools=["fail"])
    sdk.responses.create(model=DEMO_MODEL, input="please fail", tools=[failing], max_tool_calls=1)
    samples = scrape(mcp_gateway.url)
    steps = "furnace_gateway_mcp_steps_total"
    assert value(samples, steps, server=prefix, step="list", outcome="ok") == 2
    assert value(samples, steps, server=prefix, step="call", outcome="ok") == 1
    assert value(samples, steps, server=prefix, step="call", outcome="failed") == 1
    seconds = "furnace_gateway_mcp_step_seconds_count"
    assert value(samples, seconds, server=prefix, step="call") == 2


def test_streamed_the_listing_and_the_call_have_their_events(
    sdk: openai.OpenAI, mcp_url: str
) -> None:
    tool = _tool(mcp_url, require_approval="never")
    with sdk.responses.stream(model=DEMO_MODEL, input="please lookup", tools=[tool]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    expected = [
        "response.mcp_list_tools.in_progress",
        "response.mcp_list_tools.completed",
        "response.mcp_call.in_progress",
        "response.mcp_call_arguments.delta",
        "response.mcp_call_arguments.done",
        "response.mcp_call.completed",
        "response.output_text.delta",
        "response.completed",
    ]
    assert [k for k in kinds if k in expected] == sorted(
        set(expected), key=lambda k: kinds.index(k)
    )
    for kind in expected:
        assert kind in kinds
    assert kinds.index("response.mcp_call.completed") < kinds.index("response.output_text.delta")
    assert _types(final) == ["mcp_list_tools", "mcp_call", "message"]
    assert final.output_text == OUTPUT


def test_a_call_waits_for_approval_and_the_next_request_runs_it(
    sdk: openai.OpenAI, mcp_url: str
) -> None:
    first = sdk.responses.create(model=DEMO_MODEL, input="please lookup", tools=[_tool(mcp_url)])
    assert _types(first) == ["mcp_list_tools", "mcp_approval_request"]
    asked = first.output[1]
    assert asked.name == "lookup" and asked.arguments == '{"key":""}'
    approval = {"type": "mcp_approval_response", "approval_request_id": asked.id, "approve": True}
    second = sdk.responses.create(
        model=DEMO_MODEL,
        previous_response_id=first.id,
        input=[approval],
        tools=[_tool(mcp_url)],
    )
    # the conversation's listing serves: no new one
    assert _types(second) == ["mcp_call", "message"]
    call = second.output[0]
    assert call.approval_request_id == asked.id and call.output == OUTPUT
    assert second.output_text == OUTPUT
    # the stored conversation reads back whole, the call answered once
    again = sdk.responses.create(
        model=DEMO_MODEL,
        previous_response_id=second.id,
        input="say done",
        tools=[_tool(mcp_url)],
    )
    assert _types(again) == ["message"] and again.output_text == "say done"


def test_a_call_refused_is_told_to_the_model(sdk: openai.OpenAI, mcp_url: str) -> None:
    first = sdk.responses.create(model=DEMO_MODEL, input="please lookup", tools=[_tool(mcp_url)])
    refusal = {
        "type": "mcp_approval_response",
        "approval_request_id": first.output[1].id,
        "approve": False,
        "reason": "not today",
    }
    second = sdk.responses.create(
        model=DEMO_MODEL, previous_response_id=first.id, input=[refusal], tools=[_tool(mcp_url)]
    )
    assert _types(second) == ["message"]
    assert second.output_text == "The user did not approve this call: not today."


def test_approval_by_tool_name(sdk: openai.OpenAI, mcp_url: str) -> None:
    tool = _tool(mcp_url, require_approval={"never": {"tool_names": ["lookup"]}})
    response = sdk.responses.create(model=DEMO_MODEL, input="lookup and fail", tools=[tool])
    # lookup runs, fail (named under neither) waits for approval: the answer stops there
    assert _types(response) == ["mcp_list_tools", "mcp_call", "mcp_approval_request"]
    assert [item.name for item in response.output[1:]] == ["lookup", "fail"]
    assert response.output[1].output == OUTPUT


def test_a_tool_error_is_the_calls_error(sdk: openai.OpenAI, mcp_url: str) -> None:
    tool = _tool(mcp_url, require_approval="never", allowed_tools=["fail"])
    # one call: the demo, reading "Error: ... fail", would call it again and again
    response = sdk.responses.create(
        model=DEMO_MODEL, input="please fail", tools=[tool], max_tool_calls=1
    )
    assert _types(response) == ["mcp_list_tools", "mcp_call", "message"]
    listing, call, _ = response.output
    assert [t.name for t in listing.tools] == ["fail"]
    assert call.output is None and call.error == "Error executing tool fail"
    assert call.status == "failed"
    assert response.output_text.startswith("Error:")


def test_max_tool_calls_bounds_the_calls_run(sdk: openai.OpenAI, mcp_url: str) -> None:
    tool = _tool(mcp_url, require_approval="never")
    response = sdk.responses.create(
        model=DEMO_MODEL, input="please lookup", tools=[tool], max_tool_calls=0
    )
    # the call is not run; the model answers without tools
    assert _types(response) == ["mcp_list_tools", "message"]
    assert response.max_tool_calls == 0


def test_the_clients_own_function_ends_the_answer_after_the_mcp_calls(
    sdk: openai.OpenAI, mcp_url: str
) -> None:
    weather = {"type": "function", "name": "weather", "parameters": {"type": "object"}}
    tools: list[Any] = [_tool(mcp_url, require_approval="never"), weather]
    response = sdk.responses.create(model=DEMO_MODEL, input="lookup weather", tools=tools)
    assert _types(response) == ["mcp_list_tools", "function_call", "mcp_call"]
    assert response.output[1].name == "weather"


def test_authorization_reaches_the_server(sdk: openai.OpenAI, mcp_url: str) -> None:
    url = mcp_url + "?auth=1"
    tool = _tool(url, require_approval="never", authorization=TOKEN)
    response = sdk.responses.create(model=DEMO_MODEL, input="please lookup", tools=[tool])
    assert response.output_text == OUTPUT
    assert "authorization" not in response.tools[0].model_dump(exclude_none=True)
    with pytest.raises(openai.APIStatusError) as refused:
        sdk.responses.create(model=DEMO_MODEL, input="hi", tools=[_tool(url)])
    assert refused.value.status_code == 424
    assert refused.value.body["param"] == "tools[0].server_url"  # type: ignore[index]


@pytest.mark.parametrize(
    ("tool", "param"),
    [
        (_tool("http://169.254.169.254/mcp"), "tools[0].server_url"),
        (_tool("ftp://x/mcp"), "tools[0].server_url"),
        ({"type": "mcp", "server_url": "http://x/"}, "tools[0].server_label"),
        ({"type": "mcp", "server_label": "a", "connector_id": "c"}, "tools[0].connector_id"),
        (_tool("http://x/", require_approval="sometimes"), "tools[0].require_approval"),
        (_tool("http://x/", allowed_tools={"read_only": True}), "tools[0].allowed_tools.read_only"),
        (_tool("http://x/", headers={"a": 1}), "tools[0].headers"),
        (_tool("http://x/", headers={"Host": "elsewhere"}), "tools[0].headers"),
        (_tool("http://x/", tunnel_id="t"), "tools[0].tunnel_id"),
        (_tool("http://x/", defer_loading=True), "tools[0].defer_loading"),
        (_tool("http://x/", allowed_callers=["programmatic"]), "tools[0].allowed_callers"),
        (_tool("http://x/", surprise=1), "tools[0].surprise"),
    ],
)
def test_a_bad_mcp_tool_is_a_400_naming_it(
    mcp_gateway: Gateway, tool: dict[str, Any], param: str
) -> None:
    body = {"model": DEMO_MODEL, "input": "hi", "tools": [tool]}
    answer = httpx.post(f"{mcp_gateway.url}/v1/responses", json=body, timeout=HANG_GUARD)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_no_server_is_called_where_the_operator_allows_none(
    gateway_with: Callable[..., Gateway], mcp_url: str
) -> None:
    gw = gateway_with()
    body = {"model": DEMO_MODEL, "input": "hi", "tools": [_tool(mcp_url)]}
    answer = httpx.post(f"{gw.url}/v1/responses", json=body, timeout=HANG_GUARD)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "tools[0].server_url"
    assert "mcp_allowed_urls" in answer.json()["error"]["message"]


def test_an_unreachable_server_is_a_424(
    gateway_with: Callable[..., Gateway],
) -> None:
    gw = gateway_with(mcp_allowed_urls=("http://127.0.0.1:1/",), mcp_timeout=2.0)
    body = {"model": DEMO_MODEL, "input": "hi", "tools": [_tool("http://127.0.0.1:1/mcp")]}
    answer = httpx.post(f"{gw.url}/v1/responses", json=body, timeout=HANG_GUARD)
    assert answer.status_code == 424
    error = answer.json()["error"]
    assert error["type"] == "external_connector_error"
    assert error["param"] == "tools[0].server_url"


def test_the_items_sent_back_whole_serve_as_a_stored_conversation(
    sdk: openai.OpenAI, mcp_url: str
) -> None:
    # `store: false`, as agents that keep their own history send it: every item back
    first = sdk.responses.create(
        model=DEMO_MODEL, input="please lookup", tools=[_tool(mcp_url)], store=False
    )
    asked = first.output[1]
    approval = {"type": "mcp_approval_response", "approval_request_id": asked.id, "approve": True}
    items: list[Any] = [
        {"role": "user", "content": "please lookup"},
        *(item.model_dump(exclude_none=True) for item in first.output),
        approval,
    ]
    second = sdk.responses.create(
        model=DEMO_MODEL, input=items, tools=[_tool(mcp_url)], store=False
    )
    assert _types(second) == ["mcp_call", "message"]
    assert second.output[0].output == OUTPUT and second.output_text == OUTPUT


def test_in_the_background_the_calls_run_as_in_the_foreground(
    sdk: openai.OpenAI, mcp_url: str
) -> None:
    tool = _tool(mcp_url, require_approval="never")
    queued = sdk.responses.create(
        model=DEMO_MODEL, input="please lookup", tools=[tool], background=True
    )
    response = queued
    for _ in range(200):
        response = sdk.responses.retrieve(queued.id)
        if response.status not in ("queued", "in_progress"):
            break
        time.sleep(0.05)
    assert response.status == "completed"
    assert _types(response) == ["mcp_list_tools", "mcp_call", "message"]
    assert response.output_text == OUTPUT


@pytest.mark.parametrize("approval", ["never", "always"])
def test_the_agents_sdk_hosted_mcp_tool_runs_to_its_final_answer(
    mcp_gateway: Gateway, mcp_url: str, approval: str
) -> None:
    # the OpenAI Agents SDK's HostedMCPTool; with approvals asked, its callback approves
    # and the SDK sends the approval in its next request
    from agents import Agent, HostedMCPTool, OpenAIResponsesModel, Runner, set_tracing_disabled
    from agents.tool import MCPToolApprovalFunctionResult, MCPToolApprovalRequest

    set_tracing_disabled(True)
    asked: list[str] = []

    def approve(request: MCPToolApprovalRequest) -> MCPToolApprovalFunctionResult:
        asked.append(request.data.name)
        return {"approve": True}

    async def run() -> Any:
        client = openai.AsyncOpenAI(
            base_url=mcp_gateway.url + "/v1", api_key="none", max_retries=0, timeout=HANG_GUARD
        )
        async with client:
            config: Any = _tool(mcp_url, require_approval=approval)
            tool = HostedMCPTool(tool_config=config, on_approval_request=approve)
            agent = Agent(name="a", tools=[tool], model=OpenAIResponsesModel(DEMO_MODEL, client))
            return await Runner.run(agent, "please lookup")

    result = asyncio.run(asyncio.wait_for(run(), HANG_GUARD))
    assert result.final_output == OUTPUT
    assert asked == ([] if approval == "never" else ["lookup"])


def test_a_call_past_mcp_timeout_is_the_calls_error(
    gateway_with: Callable[..., Gateway], mcp_url: str
) -> None:
    gw = gateway_with(mcp_allowed_urls=(mcp_url.removesuffix("mcp"),), mcp_timeout=1.0)
    tool = _tool(mcp_url, require_approval="never", allowed_tools=["stall"])
    with openai_sdk(gw.url) as client:
        response = client.responses.create(
            model=DEMO_MODEL, input="please stall", tools=[tool], max_tool_calls=1
        )
    call = response.output[1]
    assert call.type == "mcp_call" and call.status == "failed"
    assert call.error == "The tool did not answer within 1 s."


def test_a_client_that_leaves_during_a_call_leaves_nothing_behind(
    mcp_gateway: Gateway, mcp_url: str
) -> None:
    tool = _tool(mcp_url, require_approval="never", allowed_tools=["stall"])
    body = {"model": DEMO_MODEL, "input": "please stall", "tools": [tool], "stream": True}
    url = f"{mcp_gateway.url}/v1/responses"
    with (
        httpx.Client(timeout=HANG_GUARD) as http,
        http.stream("POST", url, json=body) as answer,
    ):
        for line in answer.iter_lines():
            if "response.mcp_call.in_progress" in line:
                break  # the call runs; the client goes
    # the slot, the call and the MCP step end with the client (the gateway's teardown
    # checks every slot and call; this waits for the slot alone)
    wait_until(lambda: mcp_gateway.state.slots.in_use == 0, "the slot back")


def test_an_approval_without_its_server_among_the_tools_is_refused(
    sdk: openai.OpenAI, mcp_url: str
) -> None:
    first = sdk.responses.create(model=DEMO_MODEL, input="please lookup", tools=[_tool(mcp_url)])
    approval = {
        "type": "mcp_approval_response",
        "approval_request_id": first.output[1].id,
        "approve": True,
    }
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.responses.create(model=DEMO_MODEL, previous_response_id=first.id, input=[approval])
    assert refused.value.body["param"] == "tools"  # type: ignore[index]


def test_input_tokens_lists_the_servers_tools_as_the_answer_would(
    mcp_gateway: Gateway, mcp_url: str
) -> None:
    prefix = mcp_url.removesuffix("mcp")
    steps = "furnace_gateway_mcp_steps_total"
    before = value(scrape(mcp_gateway.url), steps, server=prefix, step="list", outcome="ok")
    url = f"{mcp_gateway.url}/v1/responses/input_tokens"
    body = {"model": DEMO_MODEL, "input": "please lookup", "tools": [_tool(mcp_url)]}
    counted = httpx.post(url, json=body, timeout=HANG_GUARD)
    assert counted.status_code == 200, counted.text
    assert counted.json()["input_tokens"] > 0
    after = value(scrape(mcp_gateway.url), steps, server=prefix, step="list", outcome="ok")
    assert after == before + 1
    elsewhere = {**body, "tools": [_tool("http://169.254.169.254/mcp")]}
    refused = httpx.post(url, json=elsewhere, timeout=HANG_GUARD)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "tools[0].server_url"
