"""Specs: compaction through a real engine: vLLM's own gRPC server (its CPU build, the tiny
random model), the gateway rendering the chat template and tokenizing (`upstream:
vllm-grpc`), the official `anthropic` and `openai` SDKs. The summary of a random model is
junk, but it is the engine's: what is checked is where it goes, counted by the gateway's
own tokenizer: the summary's prompt is the conversation's with the summarizing prompt
appended, and a summary sent back is the user message the conversation goes on from."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.edge.compacting import SUMMARIZE, SUMMARY_FRAME
from gateway.edge.responses.params import unopaque
from tests.support.fronts import Front, front_over, grpc_model, nothing_left_after_each
from tests.support.requests import whole_input
from tests.support.servers import ServerLoop, Workers
from tests.support.vllm import VllmProcess

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

MODEL = "tiny-vllm-compact"
ASKED = "tell me about the weather"


@pytest.fixture(scope="module")
def front(
    server_loop: ServerLoop, workers: Workers, vllm_grpc: VllmProcess, vllm_model: Path
) -> Iterator[Front]:
    with front_over(server_loop, (grpc_model(MODEL, vllm_grpc, vllm_model),), workers) as shared:
        yield shared


_nothing_left = nothing_left_after_each()


def count(front: Front, messages: list[dict]) -> int:
    return front.claude.messages.count_tokens(model=MODEL, messages=messages).input_tokens


def test_a_messages_summary_is_the_engines_and_the_conversation_goes_on_from_it(front):
    message = front.claude.beta.messages.create(
        model=MODEL,
        max_tokens=12,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": ASKED}],
        compaction={"type": "summarize"},
        betas=["compact-2026-01-12"],
    )
    assert [block.type for block in message.content] == ["compaction"]
    assert message.stop_reason == "compaction"
    (summary_turn,) = message.usage.iterations
    asked = [{"role": "user", "content": f"{ASKED}\n\n{SUMMARIZE}"}]
    assert whole_input(summary_turn) == count(front, asked)
    assert 0 < summary_turn.output_tokens <= 12
    summary = message.content[0].content
    assert summary, "the engine wrote a summary"
    sent_back = [
        {"role": "assistant", "content": [message.content[0].model_dump(exclude_none=True)]},
        {"role": "user", "content": "go on"},
    ]
    shown = [
        {"role": "user", "content": SUMMARY_FRAME + summary},
        {"role": "user", "content": "go on"},
    ]
    assert count(front, sent_back) == count(front, shown)
    answer = front.claude.messages.create(model=MODEL, max_tokens=4, messages=sent_back)
    assert whole_input(answer.usage) == count(front, shown)


def test_a_responses_compaction_is_the_engines_and_goes_on_from_it(front):
    conversation = [
        {"role": "user", "content": ASKED},
        {"role": "assistant", "content": "sunny"},
        {"role": "user", "content": "and tomorrow"},
    ]
    compacted = front.sdk.responses.compact(model=MODEL, input=conversation)
    *kept, item = compacted.output
    assert [m.content[0].text for m in kept] == [ASKED, "and tomorrow"]
    assert item.type == "compaction"
    asked = [*conversation[:2], {"role": "user", "content": f"and tomorrow\n\n{SUMMARIZE}"}]
    counted = front.sdk.responses.input_tokens.count(model=MODEL, input=asked)
    assert compacted.usage.input_tokens == counted.input_tokens
    summary = unopaque(item.encrypted_content, "input", [1 << 20])
    sent_back = [i.model_dump(exclude_none=True, warnings=False) for i in compacted.output]
    shown = [
        conversation[0],
        conversation[2],
        {"role": "user", "content": SUMMARY_FRAME + summary},
    ]
    turn = {"role": "user", "content": "go on"}
    back = front.sdk.responses.input_tokens.count(model=MODEL, input=[*sent_back, turn])
    assert back.input_tokens == (
        front.sdk.responses.input_tokens.count(model=MODEL, input=[*shown, turn]).input_tokens
    )


def test_a_response_past_its_threshold_compacts_through_the_engine(front):
    conversation = [
        {"role": "user", "content": ASKED},
        {"role": "assistant", "content": "sunny"},
        {"role": "user", "content": "and tomorrow"},
    ]
    answer = front.sdk.responses.create(
        model=MODEL,
        input=conversation,
        max_output_tokens=8,
        temperature=0,
        store=False,
        context_management=[{"type": "compaction", "compact_threshold": 1}],
    )
    assert [item.type for item in answer.output] == ["compaction", "message"]
    summary = unopaque(answer.output[0].encrypted_content, "input", [1 << 20])
    asked = [*conversation[:2], {"role": "user", "content": f"and tomorrow\n\n{SUMMARIZE}"}]
    gone_on = [
        conversation[0],
        conversation[2],
        {"role": "user", "content": SUMMARY_FRAME + summary},
    ]
    tokens = [
        front.sdk.responses.input_tokens.count(model=MODEL, input=prompt).input_tokens
        for prompt in (asked, gone_on)
    ]
    # both turns' prompts, counted by the gateway's own tokenizer
    assert answer.usage.input_tokens == sum(tokens)
