"""Specs: Anthropic's compaction (beta `compact-2026-01-12`) through the official
`anthropic` SDK against the real gateway and a demo worker of a long context: the
`compact_20260112` edit (below its trigger, past it, paused after the summary), the
`compaction` parameter, the block sent back in place of the conversation it
summarizes, the usage of each turn, and the refusals that name their field. The demo
echoes the last message's words and counts words as tokens, so the summary is the
echo of the last user message and the summarizing prompt after it, and the answer after
it the echo of the summary's message."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from gateway.config import ModelConfig
from gateway.edge.anthropic.compaction import MIN_TRIGGER_TOKENS
from gateway.edge.compacting import SUMMARIZE, SUMMARY_FRAME
from gateway.worker.demo import DemoEngine
from tests.support.metrics import scrape, value
from tests.support.requests import whole_input
from tests.support.servers import assert_nothing_left
from tests.support.waiting import HANG_GUARD, wait_until

MODEL = "furnace-long"
BETA = ["compact-2026-01-12"]
#: A conversation past the least trigger: a long first turn, then a short question.
LONG = " ".join(["lorem"] * MIN_TRIGGER_TOKENS)
CONVERSATION = [
    {"role": "user", "content": LONG},
    {"role": "assistant", "content": "noted"},
    {"role": "user", "content": "what now"},
]
#: Its tokens (the demo's are words).
CONVERSATION_TOKENS = MIN_TRIGGER_TOKENS + 1 + 2


def words(text: str) -> str:
    return " ".join(text.split())


#: The demo's summary of CONVERSATION: the echo of its last message with the prompt.
SUMMARY = words("what now " + SUMMARIZE)


def compact(**options: Any) -> dict[str, Any]:
    return {"edits": [{"type": "compact_20260112", **options}]}


@pytest.fixture
def claude(serve_engines, gateway_with) -> Iterator[anthropic.Anthropic]:
    (worker,) = serve_engines(DemoEngine(MODEL, max_context=4 * MIN_TRIGGER_TOKENS))
    gw = gateway_with(models=(ModelConfig(MODEL, workers=(worker.address,)),))
    with anthropic.Anthropic(
        base_url=gw.url, api_key="unused", max_retries=0, timeout=HANG_GUARD
    ) as client:
        yield client


def ask(claude: anthropic.Anthropic, **body: Any) -> Any:
    body = {"model": MODEL, "max_tokens": 256, "messages": CONVERSATION, "betas": BETA, **body}
    return claude.beta.messages.create(**body)


def test_past_its_trigger_the_answer_begins_with_the_summary_and_goes_on_from_it(claude):
    message = ask(
        claude,
        context_management=compact(trigger={"type": "input_tokens", "value": MIN_TRIGGER_TOKENS}),
    )
    assert [block.type for block in message.content] == ["compaction", "text"]
    assert message.content[0].content == SUMMARY
    # the answer's prompt was the summary's message alone
    assert message.content[1].text == words(SUMMARY_FRAME + SUMMARY)
    assert message.stop_reason == "end_turn"
    summary_turn, answer_turn = message.usage.iterations
    assert summary_turn.type == "compaction" and answer_turn.type == "message"
    assert whole_input(summary_turn) == CONVERSATION_TOKENS + len(SUMMARIZE.split())
    assert summary_turn.output_tokens == len(SUMMARY.split())
    asked = len(words(SUMMARY_FRAME + SUMMARY).split())
    assert (whole_input(answer_turn), answer_turn.output_tokens) == (asked, asked)
    # the top-level usage is the answer's turn, as Anthropic's API reports it
    assert (whole_input(message.usage), message.usage.output_tokens) == (asked, asked)


def test_below_its_trigger_the_request_is_answered_as_any_other(claude):
    short = [{"role": "user", "content": "hello there"}]
    message = ask(claude, messages=short, context_management=compact())
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == "hello there"
    assert message.usage.iterations is None
    assert message.context_management is not None
    assert message.context_management.applied_edits == []


def test_paused_after_compaction_the_answer_is_the_summary_alone(claude):
    edit = compact(
        trigger={"type": "input_tokens", "value": MIN_TRIGGER_TOKENS},
        pause_after_compaction=True,
        instructions="Summarize in five words.",
    )
    message = ask(claude, context_management=edit)
    assert [block.type for block in message.content] == ["compaction"]
    assert message.content[0].content == "what now Summarize in five words."
    assert message.stop_reason == "compaction"
    (summary_turn,) = message.usage.iterations
    assert whole_input(summary_turn) == CONVERSATION_TOKENS + 4
    assert (whole_input(message.usage), message.usage.output_tokens) == (0, 0)


def test_the_compaction_parameter_summarizes_whatever_the_prompts_size(claude):
    short = [{"role": "user", "content": "hello there"}]
    message = ask(claude, messages=short, compaction={"type": "summarize"})
    assert [block.type for block in message.content] == ["compaction"]
    assert message.content[0].content == words("hello there " + SUMMARIZE)
    assert message.stop_reason == "compaction"
    # instructions that say nothing are the default's
    blank = ask(claude, messages=short, compaction={"type": "summarize", "instructions": " "})
    assert blank.content[0].content == message.content[0].content


def test_a_streamed_compaction_is_a_block_of_its_own_before_the_answers(claude):
    edit = compact(trigger={"type": "input_tokens", "value": MIN_TRIGGER_TOKENS})
    body = {"model": MODEL, "max_tokens": 256, "messages": CONVERSATION, "betas": BETA}
    with claude.beta.messages.stream(**body, context_management=edit) as stream:
        kinds = [(e.type, getattr(e, "index", None)) for e in stream]
        message = stream.get_final_message()
    blocks = [k for k in kinds if k[0].startswith("content_block_")]
    assert blocks[:3] == [
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
    ]
    assert blocks[3] == ("content_block_start", 1)
    assert [block.type for block in message.content] == ["compaction", "text"]
    assert message.content[0].content == SUMMARY
    assert message.content[1].text == words(SUMMARY_FRAME + SUMMARY)
    assert [i.type for i in message.usage.iterations] == ["compaction", "message"]
    assert message.stop_reason == "end_turn"


def test_both_turns_are_counted_in_the_token_metrics_and_the_compaction_too(claude):
    url = str(claude.base_url).rstrip("/")
    before = value(scrape(url), "furnace_gateway_prompt_tokens_total", model=MODEL)
    message = ask(claude, context_management=compact())  # its default trigger is not reached
    assert message.usage.iterations is None
    trigger = {"type": "input_tokens", "value": MIN_TRIGGER_TOKENS}
    compacted = ask(claude, context_management=compact(trigger=trigger))
    summary_turn, answer_turn = compacted.usage.iterations
    samples = scrape(url)
    counted = value(samples, "furnace_gateway_prompt_tokens_total", model=MODEL) - before
    assert counted == CONVERSATION_TOKENS + whole_input(summary_turn) + whole_input(answer_turn)
    compactions = "furnace_gateway_compactions_total"
    assert value(samples, compactions, model=MODEL, result="summarized") == 1


def test_a_conversation_sent_back_with_its_block_goes_on_from_the_summary(claude):
    message = ask(claude, compaction={"type": "summarize"})
    block = message.content[0].model_dump(exclude_none=True)
    after = [{"role": "assistant", "content": [block]}, {"role": "user", "content": "go on"}]
    # the blocks before the last compaction block are left out: with or without them,
    # the prompt is the summary's message and what follows it
    for conversation in (after, [*CONVERSATION, *after]):
        counted = claude.beta.messages.count_tokens(
            model=MODEL, messages=conversation, betas=BETA, system="be brief"
        )
        expected = len(words("be brief " + SUMMARY_FRAME + SUMMARY + " go on").split())
        assert counted.input_tokens == expected
    answer = ask(claude, messages=[*CONVERSATION, *after])
    assert answer.content[0].text == "go on"
    # a block whose compaction failed (null content) changes nothing
    failed = {"type": "compaction", "content": None}
    turns = [
        *CONVERSATION[:2],
        {"role": "assistant", "content": [failed, {"type": "text", "text": "ok"}]},
    ]
    counted = claude.beta.messages.count_tokens(
        model=MODEL, messages=[*turns, {"role": "user", "content": "go"}], betas=BETA
    )
    assert counted.input_tokens == MIN_TRIGGER_TOKENS + 1 + 1 + 1


def test_the_block_in_the_middle_of_an_assistant_turn_leaves_out_what_came_before_it(claude):
    block = {"type": "compaction", "content": "all done", "encrypted_content": "opaque"}
    turn = {
        "role": "assistant",
        "content": [{"type": "text", "text": "before"}, block, {"type": "text", "text": "after"}],
    }
    counted = claude.beta.messages.count_tokens(
        model=MODEL, messages=[*CONVERSATION, turn, {"role": "user", "content": "go"}], betas=BETA
    )
    assert counted.input_tokens == len(words(SUMMARY_FRAME + "all done after go").split())


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"compaction": {"type": "auto"}}, "compaction.type"),
        ({"compaction": {"type": "summarize", "trigger": 1}}, "compaction.trigger"),
        ({"compaction": {"type": "summarize", "instructions": 5}}, "compaction.instructions"),
        (
            {"compaction": {"type": "summarize"}, "context_management": compact()},
            "cannot be combined with context_management",
        ),
        (
            {"context_management": compact(trigger={"type": "input_tokens", "value": 1000})},
            "edits[0].trigger.value",
        ),
        (
            {"context_management": compact(trigger={"type": "tool_uses", "value": 60000})},
            "edits[0].trigger.type",
        ),
        ({"context_management": compact(pause_after_compaction="yes")}, "pause_after_compaction"),
        ({"context_management": compact(other=1)}, "edits[0].other"),
        (
            {"context_management": {"edits": [compact()["edits"][0]] * 2}},
            "may be given once",
        ),
        (
            {
                "compaction": {"type": "summarize"},
                "mcp_servers": [{"type": "url", "url": "http://127.0.0.1:9/mcp", "name": "x"}],
            },
            "not supported together",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "content": [{"type": "compaction", "content": ""}]},
                    {"role": "user", "content": "go"},
                ]
            },
            "messages[0].content[0].content",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": [
                            {
                                "type": "compaction",
                                "content": "s",
                                "tool_changes": [{"type": "tool_addition"}],
                            }
                        ],
                    },
                    {"role": "user", "content": "go"},
                ]
            },
            "messages[0].content[0].tool_changes",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": [{"type": "compaction", "content": "s", "summary": "x"}],
                    },
                    {"role": "user", "content": "go"},
                ]
            },
            "messages[0].content[0].summary",
        ),
    ],
)
def test_compaction_refusals_name_the_field(claude, body, named):
    sent = {
        "model": MODEL,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
        **body,
    }
    with pytest.raises(anthropic.BadRequestError) as raised:
        claude.post("/v1/messages", body=sent, cast_to=httpx.Response)
    error = raised.value.body["error"]
    assert error["type"] == "invalid_request_error"
    assert named in error["message"], error


def test_a_reasoning_models_thinking_is_left_out_of_the_summary(claude):
    short = [{"role": "user", "content": "hello there"}]
    message = ask(
        claude, messages=short, compaction={"type": "summarize"}, output_config={"effort": "low"}
    )
    assert [block.type for block in message.content] == ["compaction"]
    assert message.content[0].content == words("hello there " + SUMMARIZE)
    # its thought (the demo's: the last word) is counted in the summary's turn
    assert message.usage.iterations[0].output_tokens == len(message.content[0].content.split()) + 1


def test_a_client_that_leaves_during_the_summary_leaves_nothing_behind(serve_engines, gateway_with):
    (worker,) = serve_engines(DemoEngine(MODEL, max_context=4096, token_delay=0.05))
    gw = gateway_with(models=(ModelConfig(MODEL, workers=(worker.address,)),))
    body = {
        "model": MODEL,
        "max_tokens": 256,
        "stream": True,
        "messages": [{"role": "user", "content": "hello there"}],
        "compaction": {"type": "summarize"},
    }
    with (
        httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client,
        client.stream("POST", "/v1/messages", json=body) as answer,
    ):
        lines = answer.iter_lines()
        assert next(lines) == "event: message_start"
    # the summary's turn (some 4 s at the demo's pace) is cancelled with the stream
    assert_nothing_left(gw, None)


def test_a_message_batchs_request_compacts_as_a_message_does(claude):
    short = [{"role": "user", "content": "hello there"}]
    params = {"model": MODEL, "max_tokens": 256, "messages": short}
    batch = claude.messages.batches.create(
        requests=[
            {"custom_id": "summary", "params": {**params, "compaction": {"type": "summarize"}}}
        ]
    )

    def ended() -> bool:
        return claude.messages.batches.retrieve(batch.id).processing_status == "ended"

    wait_until(ended, f"{batch.id} to end")
    (result,) = claude.messages.batches.results(batch.id)
    assert result.result.type == "succeeded", result
    message = result.result.message
    assert message.stop_reason == "compaction"
    assert [(block.type, block.content) for block in message.content] == [
        ("compaction", words("hello there " + SUMMARIZE))
    ]
