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

The summary is a turn of the model's own (`CompactionTurns`, the call the route's pump
reads, as the MCP connector's turns are): the prompt as it came, with the summarizing
prompt as the last user message and no tool to call, so the engine's prefix cache holds
all of it but that message. Its text, stripped, is the block's `content`; a turn that
wrote none gives `content` null (a failed compaction, as Anthropic's block says one) and
the answer goes on from the whole prompt. The next turn's prompt is the request's system
prompt and the summary as the conversation's first user message (`summary_message`), as
is every later request's that sends the block back: the parser leaves out a
conversation's blocks before its last compaction block (validation.py), and a block
with null content changes nothing. The summary is bounded by the request's `max_tokens`,
and so is the answer after it.

Tokens: the summary's turn is an iteration of its own in the answer's `usage.iterations`
(type "compaction"), left out of the top-level usage, as Anthropic's API reports it; the
ledger, the budgets, the team's limits and the token metrics count both turns (the engine
ran both), from the last `Finished`, which holds their sum.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, cast

from gateway.edge.compacting import SUMMARIZE, summary_message
from gateway.edge.errors import invalid
from gateway.protocol import errors
from gateway.protocol.deadline import Deadline
from gateway.protocol.types import (
    Event,
    Finished,
    FinishReason,
    GenerateRequest,
    Started,
    Text,
)
from gateway.upstreams.base import CANCELLED, CallEnd, UpstreamCall

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


class Compacted(NamedTuple):
    """The summary's turn ended: its text (None: it wrote none), its tokens, and whether
    the answer ends here."""

    summary: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    paused: bool


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


def going_on(
    request: GenerateRequest, asked: GenerateRequest, summary: str | None
) -> GenerateRequest:
    """The answer's turn after the summary: `request` (the summary's turn as the fleet
    was given it) with what the client `asked` for its answer, from the system prompt and
    the summary (from the whole prompt, when there is no summary)."""
    messages = asked.messages or ()
    if summary is not None:
        system = tuple(m for m in messages[:1] if m.role == "system")
        messages = (*system, summary_message(summary))
    return replace(
        request,
        messages=messages,
        tool_choice=asked.tool_choice,
        response_format=asked.response_format,
        stop=asked.stop,
    )


StartTurn = Callable[[GenerateRequest], Awaitable[tuple[Started, UpstreamCall]]]


def compaction_start(
    compaction: Compaction,
    request: GenerateRequest,
    asked: GenerateRequest,
    start: Coroutine[Any, Any, tuple[Started, UpstreamCall]],
    start_turn: StartTurn,
    deadline: Deadline,
) -> Coroutine[Any, Any, tuple[Started, UpstreamCall]]:
    """The start of a compacting answer for the route's pump, from its summary turn's
    `start` (`request`, as the fleet was given it; `asked`: the request as parsed)."""

    async def begin() -> tuple[Started, UpstreamCall]:
        started, call = await start
        return started, CompactionTurns(
            compaction, request, asked, started, call, start_turn, deadline
        )

    return begin()


class CompactionTurns:
    """The summary's turn, then (unless paused) the answer's, as one call."""

    def __init__(
        self,
        compaction: Compaction,
        request: GenerateRequest,
        asked: GenerateRequest,
        started: Started,
        call: UpstreamCall,
        start_turn: StartTurn,
        deadline: Deadline,
    ) -> None:
        self.compaction = compaction
        self._request = request
        self._asked = asked
        self._started = started
        self._call = call
        self.worker = call.worker
        self._start_turn = start_turn
        self._deadline = deadline
        self._events = self._run()

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        # the Messages encoder reads `Compacted` too; the pump passes it on
        return cast(Event, await self._events.__anext__())

    def cancel(self, outcome: CallEnd = CANCELLED) -> None:
        self._call.cancel(outcome)

    def close(self, outcome: CallEnd = None) -> None:
        self._call.close(outcome)

    async def _ended(self) -> tuple[Finished, list[str]]:
        """The turn in flight's texts and its end; its thinking and anything else left."""
        texts: list[str] = []
        async for event in self._call:
            if type(event) is Text:
                texts.append(event.text)
            elif type(event) is Finished:
                self._call.close()
                return event, texts
        raise errors.Failed("The engine worker ended the answer without its end.")

    def _counts(self, finished: Finished) -> tuple[int, int]:
        """A turn's prompt and cached tokens: an upstream that counts the prompt only at
        the end (OpenAI-compatible servers) says it there, and the end's count wins."""
        started = self._started
        prompt = started.prompt_tokens if finished.prompt_tokens is None else finished.prompt_tokens
        cached = started.cached_tokens if finished.cached_tokens is None else finished.cached_tokens
        return prompt, cached

    async def _run(self) -> AsyncIterator[Event | Compacted]:
        finished, texts = await self._ended()
        summary = "".join(texts).strip() or None
        prompt, cached = self._counts(finished)
        written = finished.completion_tokens
        paused = self.compaction.pause
        yield Compacted(summary, prompt, written, cached, paused)
        if paused:
            yield Finished(FinishReason.STOP, written, prompt, cached_tokens=cached)
            return
        if self._deadline.remaining() <= 0:
            raise errors.Timeout("The answer's turns took longer than the request may.")
        turn = going_on(self._request, self._asked, summary)
        self._started, self._call = await self._start_turn(turn)
        self.worker = self._call.worker
        async for event in self._call:
            if type(event) is Finished:
                turn_prompt, turn_cached = self._counts(event)
                self._call.close()
                yield event._replace(
                    completion_tokens=written + event.completion_tokens,
                    prompt_tokens=prompt + turn_prompt,
                    cached_tokens=cached + turn_cached,
                )
                return
            yield event
        raise errors.Failed("The engine worker ended the answer without its end.")
