"""Specs: the Responses API's compaction through the official `openai` SDK against the
real gateway and a demo worker: `POST /v1/responses/compact` (the conversation's user
messages, then one `compaction` item), that item sent back as input in place of the
conversation, a stored conversation compacted by `previous_response_id`, server-side
compaction (`context_management`: the answer begins with the item once the prompt reaches
its threshold, and a stored conversation goes on from it), and the refusals that name
their parameter. The demo echoes the last message's words and counts words as tokens, so the
summary is the echo of the last user message with the summarizing prompt after it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from agents import Agent, OpenAIResponsesModel, Runner, SQLiteSession, set_tracing_disabled
from agents.memory import OpenAIResponsesCompactionSession

from gateway.config import ModelConfig
from gateway.edge.compacting import SUMMARIZE, SUMMARY_FRAME
from gateway.edge.responses.params import OPAQUE_PREFIX
from gateway.worker.demo import DemoEngine
from tests.support.script_engine import ScriptEngine
from tests.support.waiting import HANG_GUARD

MODEL = "furnace-compact"
CONVERSATION = [
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "hi"},
    {"role": "user", "content": "what now"},
]


def words(text: str) -> str:
    return " ".join(text.split())


#: The demo's summary of CONVERSATION.
SUMMARY = words("what now " + SUMMARIZE)


@pytest.fixture
def client(serve_engines, gateway_with) -> Iterator[openai.OpenAI]:
    (worker,) = serve_engines(DemoEngine(MODEL, max_context=4096))
    gw = gateway_with(models=(ModelConfig(MODEL, workers=(worker.address,)),))
    with openai.OpenAI(
        base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD
    ) as sdk:
        yield sdk


def sent_back(compacted: Any) -> list[dict[str, Any]]:
    """The compacted items as a client sends them back (the SDK types a user message
    among output items as an output message: its `input_text` parts warn, and are kept)."""
    return [item.model_dump(exclude_none=True, warnings=False) for item in compacted.output]


def test_a_conversation_is_compacted_into_its_user_messages_and_a_summary(client):
    compacted = client.responses.compact(model=MODEL, input=CONVERSATION)
    assert compacted.object == "response.compaction" and compacted.id.startswith("resp_")
    *kept, summary = compacted.output
    assert [(m.type, m.role, m.content[0].text) for m in kept] == [
        ("message", "user", "hello there"),
        ("message", "user", "what now"),
    ]
    assert summary.type == "compaction" and summary.id.startswith("cmp_")
    assert summary.encrypted_content.startswith(OPAQUE_PREFIX)
    # the summary's prompt: the conversation, the summarizing prompt in its last message
    assert compacted.usage.input_tokens == 2 + 1 + len(SUMMARY.split())
    assert compacted.usage.output_tokens == len(SUMMARY.split())


def test_the_compaction_item_sent_back_is_the_summary_the_conversation_goes_on_from(client):
    compacted = client.responses.compact(model=MODEL, input=CONVERSATION)
    turn = [*sent_back(compacted), {"role": "user", "content": "go on"}]
    counted = client.responses.input_tokens.count(model=MODEL, input=turn)
    shown = words("hello there what now " + SUMMARY_FRAME + SUMMARY + " go on")
    assert counted.input_tokens == len(shown.split())
    answer = client.responses.create(model=MODEL, input=turn, max_output_tokens=8, store=False)
    assert answer.output_text == "go on"
    assert answer.usage.input_tokens == counted.input_tokens
    # compacted again, the earlier summary is in the new one's prompt, not in its output
    again = client.responses.compact(model=MODEL, input=turn)
    assert [item.type for item in again.output] == ["message", "message", "message", "compaction"]
    assert again.usage.input_tokens == counted.input_tokens + len(SUMMARIZE.split())


def test_a_stored_conversation_is_compacted_by_its_last_response(client):
    first = client.responses.create(model=MODEL, input="hello there", max_output_tokens=8)
    compacted = client.responses.compact(
        model=MODEL, previous_response_id=first.id, input="what now", instructions="be brief"
    )
    *kept, summary = compacted.output
    assert [m.content[0].text for m in kept] == ["hello there", "what now"]
    assert summary.type == "compaction"
    # instructions, the first turn, its answer, the question and the summarizing prompt
    assert compacted.usage.input_tokens == 2 + 2 + 2 + len(SUMMARY.split())


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"stream": True}, "stream"),
        ({"tools": []}, "tools"),
        ({"max_output_tokens": 8}, "max_output_tokens"),
        ({"image": {"context_compression": "enabled"}}, "image"),
        ({"prompt_cache_options": {"mode": "explicit"}}, "prompt_cache_options"),
        ({"input": [{"type": "compaction"}]}, "input[0].encrypted_content"),
        ({"input": [{"type": "compaction", "encrypted_content": "gAAAA-openai"}]}, "input[0]"),
        (
            {"input": [{"type": "compaction", "encrypted_content": OPAQUE_PREFIX + "!!"}]},
            "input[0].encrypted_content",
        ),
        ({"previous_response_id": "resp_nowhere"}, "previous_response_id"),
    ],
)
def test_compact_refusals_name_the_parameter(client, body, named):
    sent = {"model": MODEL, "input": CONVERSATION, **body}
    with pytest.raises(openai.APIStatusError) as raised:
        client.post("/responses/compact", body=sent, cast_to=httpx.Response)
    assert raised.value.status_code in (400, 404)
    error = raised.value.body
    assert isinstance(error, dict) and error["param"].startswith(named.split(".")[0]), error
    assert named.split("[")[0] in error["param"] or named in error["message"], error


def test_a_foreign_compaction_item_is_refused_in_words_that_say_why(client):
    foreign = {"type": "compaction", "encrypted_content": "gAAAAABopenai"}
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model=MODEL, input=[foreign, {"role": "user", "content": "go"}])
    error = raised.value.body
    assert isinstance(error, dict) and error["param"] == "input[0].encrypted_content"
    assert "not made by this gateway" in error["message"] and "compaction" in error["message"]


def test_the_agents_sdks_compaction_session_compacts_and_goes_on(serve_engines, gateway_with):
    """The OpenAI Agents SDK's `OpenAIResponsesCompactionSession` (it takes OpenAI's model
    names alone) compacts a session's history after a turn by `responses.compact`, and the
    next turn goes on from the compacted history."""
    set_tracing_disabled(True)  # the SDK would export its traces to OpenAI's servers
    model = "gpt-furnace"
    (worker,) = serve_engines(DemoEngine(model, max_context=4096))
    gw = gateway_with(models=(ModelConfig(model, workers=(worker.address,)),))

    async def run() -> tuple[list[Any], str]:
        async with openai.AsyncOpenAI(
            base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD
        ) as sdk:
            session = OpenAIResponsesCompactionSession(
                "spec",
                SQLiteSession("spec"),
                client=sdk,
                model=model,
                compaction_mode="input",
                should_trigger_compaction=lambda _: True,
            )
            agent = Agent(name="echo", model=OpenAIResponsesModel(model, sdk))
            await Runner.run(agent, "hello there", session=session)
            compacted = await session.get_items()
            result = await Runner.run(agent, "go on", session=session)
            return compacted, str(result.final_output)

    compacted, answer = asyncio.run(asyncio.wait_for(run(), HANG_GUARD))
    assert [item["type"] for item in compacted] == ["message", "compaction"]
    assert answer == "go on"


def compacting(threshold: int | None = 3) -> list[dict[str, Any]]:
    entry: dict[str, Any] = {"type": "compaction"}
    if threshold is not None:
        entry["compact_threshold"] = threshold
    return [entry]


#: The prompt an answer goes on from after compacting CONVERSATION: its user messages,
#: then the summary's message.
GONE_ON = words("hello there what now " + SUMMARY_FRAME + SUMMARY)


def test_past_its_threshold_an_answer_begins_with_the_compaction_item(client):
    answer = client.responses.create(
        model=MODEL, input=CONVERSATION, context_management=compacting(), max_output_tokens=256
    )
    assert [item.type for item in answer.output] == ["compaction", "message"]
    assert answer.output[0].encrypted_content.startswith(OPAQUE_PREFIX)
    assert answer.output[0].id.startswith("cmp_")
    # the answer's prompt: the user's messages and the summary (the demo echoes the last)
    assert answer.output_text == words(SUMMARY_FRAME + SUMMARY)
    summary_prompt = 2 + 1 + len(SUMMARY.split())
    assert answer.usage.input_tokens == summary_prompt + len(GONE_ON.split())
    assert answer.usage.output_tokens == len(SUMMARY.split()) + len(
        words(SUMMARY_FRAME + SUMMARY).split()
    )


def test_below_its_threshold_an_answer_compacts_nothing(client):
    for entries in (compacting(100), compacting(None), []):  # the default: 80 % of 4096
        answer = client.responses.create(
            model=MODEL, input=CONVERSATION, context_management=entries, max_output_tokens=8
        )
        assert [item.type for item in answer.output] == ["message"]
        assert answer.output_text == "what now"


def test_a_streamed_compaction_is_an_item_made_whole_before_the_answer(client):
    with client.responses.stream(
        model=MODEL, input=CONVERSATION, context_management=compacting(), max_output_tokens=256
    ) as stream:
        kinds = [(e.type, getattr(e, "output_index", None)) for e in stream]
        final = stream.get_final_response()
    assert kinds[2:5] == [
        ("response.output_item.added", 0),
        ("response.compaction.compacting", 0),
        ("response.output_item.done", 0),
    ]
    assert kinds[5] == ("response.output_item.added", 1)
    assert [item.type for item in final.output] == ["compaction", "message"]
    assert final.output_text == words(SUMMARY_FRAME + SUMMARY)


def test_a_stored_conversation_goes_on_from_its_compaction(client):
    first = client.responses.create(
        model=MODEL, input=CONVERSATION, context_management=compacting(), max_output_tokens=256
    )
    asked = {"model": MODEL, "previous_response_id": first.id, "input": "go on"}
    counted = client.responses.input_tokens.count(**asked)
    # before the compaction item, only the user's messages are left
    shown = words(GONE_ON + " " + first.output_text + " go on")
    assert counted.input_tokens == len(shown.split())
    answer = client.responses.create(**asked, max_output_tokens=8)
    assert answer.output_text == "go on" and answer.usage.input_tokens == counted.input_tokens
    # an item reference names the stored compaction item
    again = client.responses.input_tokens.count(
        model=MODEL,
        input=[
            *CONVERSATION,
            {"type": "item_reference", "id": first.output[0].id},
            {"role": "user", "content": "go on"},
        ],
    )
    assert again.input_tokens == len(words(GONE_ON + " go on").split())


@pytest.mark.parametrize(
    ("management", "named"),
    [
        ({"type": "compaction"}, "context_management"),
        ([{"type": "truncation"}], "context_management[0].type"),
        ([{"type": "compaction", "keep": 1}], "context_management[0].keep"),
        (
            [{"type": "compaction", "compact_threshold": 0}],
            "context_management[0].compact_threshold",
        ),
        (
            [{"type": "compaction", "compact_threshold": "many"}],
            "context_management[0].compact_threshold",
        ),
        (compacting() * 2, "context_management"),
    ],
)
def test_context_management_refusals_name_the_parameter(client, management, named):
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model=MODEL, input="hi", context_management=management)
    error = raised.value.body
    assert isinstance(error, dict) and error["param"] == named, error


def test_a_model_that_cannot_count_refuses_context_management(serve_engines, gateway_with):
    """A model whose workers cannot count the prompt (an engine without a tokenizer, as an
    OpenAI-compatible server without `/tokenize`) cannot tell when to compact."""
    (worker,) = serve_engines(ScriptEngine([]))
    gw = gateway_with(models=(ModelConfig("script-engine", workers=(worker.address,)),))
    with (
        openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0) as sdk,
        pytest.raises(openai.BadRequestError) as raised,
    ):
        sdk.responses.create(model="script-engine", input="hi", context_management=compacting())
    error = raised.value.body
    assert isinstance(error, dict) and error["param"] == "context_management", error
    assert "cannot count" in error["message"]
