"""Anthropic's context editing (`context_management.edits`): what the edits leave out
of a Messages prompt before it is sent, and what the answer says they cleared.

- `clear_thinking_20251015` leaves out the thinking of all but the last `keep` assistant
  turns that have some. It needs no count, so the body's parser applies it
  (`validation.py`); here its cleared tokens are counted: the prompt as it came, less the
  prompt without those thoughts.
- `clear_tool_uses_20250919`, once the prompt passes its `trigger` (its input tokens,
  100,000 by default, or its tool uses), replaces the results of every tool use but the
  last `keep` (3) with `CLEARED_RESULT`, oldest first, passing over the tools named in
  `exclude_tools`; with `clear_tool_inputs` (true, or the tools' names) the calls' inputs
  too, with `{}`; with `clear_at_least`, only when that clears at least so many tokens.
  Deciding needs the prompt counted: the route applies it (`edit`), in the request's
  slot, where the model's tokenizer is (the gateway's own for `vllm-grpc`, else a
  worker's `CountTokens`), as count_tokens counts.

Each count is a call the request makes before its generation: one for each edit that
clears, of the prompt before it (its `cleared_input_tokens` is that less the prompt after
it: the next edit's count, or the answer's usage), which for an `input_tokens` trigger is
the count that decides; one more for a `clear_at_least` check. None for edits that clear
nothing by rules that need no count (`keep: "all"`, a tool-uses trigger not reached).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from gateway.protocol.types import Message

if TYPE_CHECKING:
    from gateway.edge.anthropic.compaction import Compaction
    from gateway.edge.counting import PromptCount

CLEAR_THINKING = "clear_thinking_20251015"
CLEAR_TOOL_USES = "clear_tool_uses_20250919"
#: What a cleared tool result says in its place.
CLEARED_RESULT = "[This tool result was cleared to save context.]"
#: A cleared call's input.
CLEARED_INPUT = "{}"
#: `clear_tool_uses_20250919`'s default trigger: the prompt's input tokens past this.
TRIGGER_TOKENS = 100_000
#: ... and how many of the last tool uses it keeps.
KEEP_TOOL_USES = 3


@dataclass(frozen=True, slots=True)
class ToolClearing:
    """A request's `clear_tool_uses_20250919` edit, its defaults filled in. The trigger
    is input tokens (`trigger_tokens`) or tool uses (`trigger_uses`), one of them set;
    `inputs` is True (every cleared use's input), or the tools whose inputs are cleared."""

    trigger_tokens: int | None = TRIGGER_TOKENS
    trigger_uses: int | None = None
    keep: int = KEEP_TOOL_USES
    clear_at_least: int = 0
    exclude: frozenset[str] = frozenset()
    inputs: bool | frozenset[str] = False

    def clears_input(self, name: str) -> bool:
        inputs = self.inputs
        return inputs if isinstance(inputs, bool) else name in inputs


@dataclass(frozen=True, slots=True)
class ContextEdits:
    """What a request's `context_management` asks: the assistant turns whose thinking its
    parser left out (`cleared_turns`) and, when any, the messages as they came
    (`unedited`); its tool clearing (`tools`), which the route applies; its compaction
    (compaction.py), which the route applies after the others."""

    cleared_turns: int = 0
    unedited: tuple[Message, ...] | None = None
    tools: ToolClearing | None = None
    compaction: Compaction | None = None


@dataclass(frozen=True, slots=True)
class Applied:
    """An edit that cleared something: its type, what it cleared (the answer's field
    and how many), and the tokens of the prompt before it."""

    type: str
    field: str
    cleared: int
    tokens_before: int


def applied_edits(applied: Sequence[Applied], prompt_tokens: int) -> list[dict[str, Any]]:
    """The answer's `applied_edits`: each edit's `cleared_input_tokens` is the prompt
    before it less the prompt after it (the next edit's before, or the prompt sent)."""
    report = []
    for i, edit in enumerate(applied):
        after = applied[i + 1].tokens_before if i + 1 < len(applied) else prompt_tokens
        cleared = max(0, edit.tokens_before - after)
        report.append(
            {"type": edit.type, edit.field: edit.cleared, "cleared_input_tokens": cleared}
        )
    return report


def once(count: PromptCount, messages: tuple[Message, ...], tokens: int) -> PromptCount:
    """`count`, with `messages` already counted as `tokens`, and each prompt it counts
    kept (by identity) so a prompt is counted once."""
    known: dict[int, tuple[tuple[Message, ...], int]] = {id(messages): (messages, tokens)}

    async def counted(prompt: tuple[Message, ...]) -> int:
        kept = known.get(id(prompt))
        if kept is not None and kept[0] is prompt:
            return kept[1]
        tokens = await count(prompt)
        known[id(prompt)] = (prompt, tokens)
        return tokens

    return counted


async def edit(
    messages: tuple[Message, ...], edits: ContextEdits, count: PromptCount
) -> tuple[tuple[Message, ...], tuple[Applied, ...]]:
    """The prompt's messages as the edits leave them (`messages`: as the parser left
    them, their thinking cleared), and the edits that cleared something, in order."""
    applied = []
    if edits.unedited is not None:
        before = await count(edits.unedited)
        applied.append(
            Applied(CLEAR_THINKING, "cleared_thinking_turns", edits.cleared_turns, before)
        )
    if edits.tools is not None:
        messages, cleared = await _clear_tool_uses(messages, edits.tools, count)
        if cleared is not None:
            applied.append(cleared)
    return messages, tuple(applied)


@dataclass(frozen=True, slots=True)
class _Use:
    """A tool use of the conversation: its call's message and the result's, by index."""

    call: int
    result: int
    id: str
    name: str


def _tool_uses(messages: tuple[Message, ...]) -> list[_Use]:
    """The conversation's tool uses with a result, in the order of their results (the
    parser has paired each result with a call of the assistant message before it)."""
    calls: dict[str, tuple[int, str]] = {}
    uses = []
    for i, message in enumerate(messages):
        if message.role == "assistant":
            for call in message.tool_calls:
                calls[call.id] = (i, call.name)
        elif message.role == "tool" and message.tool_call_id in calls:
            at, name = calls[message.tool_call_id]
            uses.append(_Use(at, i, message.tool_call_id, name))
    return uses


async def _clear_tool_uses(
    messages: tuple[Message, ...], clearing: ToolClearing, count: PromptCount
) -> tuple[tuple[Message, ...], Applied | None]:
    uses = _tool_uses(messages)
    tokens: int | None = None
    if clearing.trigger_uses is not None:
        if len(uses) <= clearing.trigger_uses:
            return messages, None
    else:
        tokens = await count(messages)
        if clearing.trigger_tokens is None or tokens <= clearing.trigger_tokens:
            return messages, None
    edited = list(messages)
    cleared = 0
    for use in uses[: max(0, len(uses) - clearing.keep)]:
        if use.name in clearing.exclude:
            continue
        edited[use.result] = replace(
            edited[use.result], content=CLEARED_RESULT, images=(), parts=()
        )
        if clearing.clears_input(use.name):
            caller = edited[use.call]
            calls = tuple(
                replace(call, arguments=CLEARED_INPUT) if call.id == use.id else call
                for call in caller.tool_calls
            )
            edited[use.call] = replace(caller, tool_calls=calls)
        cleared += 1
    if not cleared:
        return messages, None
    result = tuple(edited)
    if tokens is None:
        tokens = await count(messages)
    if clearing.clear_at_least and tokens - await count(result) < clearing.clear_at_least:
        return messages, None  # not worth a prompt its prefix cache no longer holds
    return result, Applied(CLEAR_TOOL_USES, "cleared_tool_uses", cleared, tokens)
