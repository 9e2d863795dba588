"""Anthropic's compaction (beta `compact-2026-01-12`): a long conversation summarized
by the model itself, so that it goes on from the summary.

- `context_management.edits` `compact_20260112`: once the prompt reaches its `trigger`
  (its input tokens, `TRIGGER_TOKENS` unless it says, at least `MIN_TRIGGER_TOKENS`), the
  answer begins with a `compaction` block, the model's summary of the conversation, and
  goes on from that summary; with `pause_after_compaction` it ends after the block
  (`stop_reason` "compaction"). Below the trigger the request is answered as any other.
- The `compaction` parameter (`{"type": "summarize"}`): the answer is that block alone,
  whatever the prompt's size (`stop_reason` "compaction").

`instructions` replace the summarizing prompt (gateway/edge/compacting.py) for the
request, as Anthropic's do; one empty or only whitespace counts as absent.

The summary is a turn of the model's own (gateway/edge/compacting.py: `summarizing`,
`CompactionTurns`): the prompt as it came, with the summarizing prompt as the last user
message and no tool to call, so the engine's prefix cache holds all of it but that
message. Its text, stripped, is the block's `content`; a turn that wrote none gives
`content` null (a failed compaction, as Anthropic's block says one) and the answer goes
on from the whole prompt. The next turn's prompt is the request's system prompt and the
summary as the conversation's first user message (`going_on`), as is every later
request's that sends the block back: the parser leaves out a conversation's blocks before
its last compaction block (validation.py), and a block with null content changes
nothing. The summary is bounded by the request's `max_tokens`, and so is the answer
after it.

Tokens: the summary's turn is an iteration of its own in the answer's `usage.iterations`
(type "compaction"), left out of the top-level usage, as Anthropic's API reports it; the
ledger, the budgets, the team's limits and the token metrics count both turns (the engine
ran both), from the last `Finished`, which holds their sum.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.edge.compacting import SUMMARIZE, summary_message
from gateway.edge.errors import invalid
from gateway.protocol.types import GenerateRequest, Message

#: The edit's type, in `context_management.edits`.
COMPACT = "compact_20260112"
#: The `compaction` parameter's only type.
SUMMARIZE_TYPE = "summarize"
#: The edit's trigger when it names none: the prompt's input tokens, as Anthropic's.
TRIGGER_TOKENS = 150_000
#: The least trigger the edit may name, as Anthropic's.
MIN_TRIGGER_TOKENS = 50_000
#: The longest `instructions` taken, in characters.
MAX_INSTRUCTIONS_CHARS = 32_768
_EDIT_FIELDS = frozenset({"type", "trigger", "pause_after_compaction", "instructions"})


@dataclass(frozen=True, slots=True)
class Compaction:
    """What a request's compaction asks: the prompt's tokens from which it compacts
    (None: whatever its size, the `compaction` parameter), whether the answer ends after
    the summary, and the summarizing prompt."""

    trigger: int | None = TRIGGER_TOKENS
    pause: bool = False
    instructions: str = SUMMARIZE


def _instructions(value: Any, where: str) -> str:
    if value is None:
        return SUMMARIZE
    if not isinstance(value, str) or len(value) > MAX_INSTRUCTIONS_CHARS:
        raise invalid(
            where, f"{where}: a string of at most {MAX_INSTRUCTIONS_CHARS} characters, or null."
        )
    return value.strip() or SUMMARIZE


def parse_edit(edit: Mapping[str, Any], where: str) -> Compaction:
    """A `compact_20260112` edit, checked, its defaults filled in."""
    extra = sorted(name for name in edit.keys() - _EDIT_FIELDS if edit[name] is not None)
    if extra:
        raise invalid(f"{where}.{extra[0]}", f"{where}.{extra[0]}: Extra inputs are not permitted.")
    trigger = edit.get("trigger")
    tokens = TRIGGER_TOKENS
    if trigger is not None:
        at = f"{where}.trigger"
        if not isinstance(trigger, Mapping) or trigger.get("type") != "input_tokens":
            raise invalid(f"{at}.type", f"{at}.type: 'input_tokens'.")
        if trigger.keys() - {"type", "value"}:
            name = min(trigger.keys() - {"type", "value"})
            raise invalid(f"{at}.{name}", f"{at}.{name}: Extra inputs are not permitted.")
        value = trigger.get("value")
        if isinstance(value, bool) or not isinstance(value, int) or value < MIN_TRIGGER_TOKENS:
            raise invalid(
                f"{at}.value", f"{at}.value: an integer of at least {MIN_TRIGGER_TOKENS}."
            )
        tokens = value
    pause = edit.get("pause_after_compaction")
    if pause is not None and not isinstance(pause, bool):
        raise invalid(
            f"{where}.pause_after_compaction", f"{where}.pause_after_compaction: a boolean."
        )
    instructions = _instructions(edit.get("instructions"), f"{where}.instructions")
    return Compaction(tokens, bool(pause), instructions)


def parse_parameter(config: Any) -> Compaction | None:
    """The `compaction` parameter, checked (None: not given)."""
    if config is None:
        return None
    if not isinstance(config, Mapping) or config.get("type") != SUMMARIZE_TYPE:
        raise invalid("compaction.type", f"compaction.type: '{SUMMARIZE_TYPE}'.")
    extra = sorted(
        name for name in config.keys() - {"type", "instructions"} if config[name] is not None
    )
    if extra:
        raise invalid(
            f"compaction.{extra[0]}", f"compaction.{extra[0]}: Extra inputs are not permitted."
        )
    instructions = _instructions(config.get("instructions"), "compaction.instructions")
    return Compaction(None, True, instructions)


def going_on(asked: GenerateRequest, summary: str) -> tuple[Message, ...]:
    """The prompt the answer goes on from after its `summary`: the system prompt the
    client `asked` with, then the summary's message."""
    messages = asked.messages or ()
    system = tuple(m for m in messages[:1] if m.role == "system")
    return (*system, summary_message(summary))
