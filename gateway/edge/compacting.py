"""A conversation summarized by its own model, so that it goes on from the summary:
the prompt that asks for the summary, the message a conversation goes on from, and
the turns of an answer that compacts as it goes (`CompactionTurns`). One wording and
one way for every API that compacts (Anthropic's compaction:
gateway/edge/anthropic/compaction.py; the Responses API's `/v1/responses/compact` and
`context_management`: gateway/edge/responses/), so that a summary reads the same to the
model whichever API made it.

`CompactionTurns` is the call the route's pump reads (as the MCP connector's turns
are): the summary's turn, whose text it gathers (its thinking and anything else left
out) into one `Compacted` event for the API's encoder, then, unless the answer pauses
there, the answer's turn from the prompt the API makes of the summary (`goes_on`; from
the whole prompt, when the model wrote no summary), relayed. Its last `Finished`
holds both turns' tokens, which the ledger, the budgets, the team's limits and the
token metrics count (the engine ran both); `Compacted` says the summary's own, for an
API that reports them apart. A client that leaves cancels the turn in flight.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import replace
from typing import Any, NamedTuple, Protocol, cast, runtime_checkable

from gateway.protocol import errors
from gateway.protocol.deadline import Deadline
from gateway.protocol.types import (
    Event,
    Finished,
    FinishReason,
    GenerateRequest,
    Message,
    Started,
    Text,
    turn_counts,
)
from gateway.upstreams.base import CANCELLED, CallEnd, UpstreamCall

#: What the model is asked after the conversation, unless the client gives its own.
SUMMARIZE = (
    "Stop here and write a summary of this whole conversation, in place of it, so that "
    "the work can go on from the summary alone: what the user asked for and still wants, "
    "the decisions taken and why, the state of the work (files, code, commands and their "
    "results that still matter, with the exact names and values), what failed and how it "
    "was fixed, and what is left to do next. Write only the summary."
)
#: How the summary opens the conversation that goes on from it.
SUMMARY_FRAME = "The conversation so far, summarized:\n\n"


def summary_message(summary: str) -> Message:
    """The user message a conversation goes on from, after its summary."""
    return Message("user", SUMMARY_FRAME + summary)


def summarizing(request: GenerateRequest, instructions: str = SUMMARIZE) -> GenerateRequest:
    """The turn that writes the summary: the prompt as it came and `instructions` after
    it (in the last user message, when that is text alone: the roles still alternate),
    so that the engine's prefix cache holds all but that message; no tool to call, no
    format nor stop string of the answer's."""
    messages = list(request.messages or ())
    last = messages[-1] if messages else None
    if last is not None and last.role == "user" and not last.images and not last.parts:
        messages[-1] = replace(last, content=f"{last.content}\n\n{instructions}")
    else:
        messages.append(Message("user", instructions))
    choice = "none" if request.tools else request.tool_choice
    return replace(
        request, messages=tuple(messages), tool_choice=choice, response_format=None, stop=()
    )


class Compacted(NamedTuple):
    """The summary's turn ended: its text (None: it wrote none), its tokens, and whether
    the answer ends here."""

    summary: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    paused: bool


#: Starts the answer's next turn on the pool that serves (the route's `turns` makes it).
StartTurn = Callable[[GenerateRequest], Awaitable[tuple[Started, UpstreamCall]]]
#: The prompt an answer goes on from after its summary.
GoesOn = Callable[[str], tuple[Message, ...]]


@runtime_checkable
class Compacting(Protocol):
    """A parsed request whose answer compacts (each API's: its `turns` are true): the
    generation route starts it as `CompactionTurns`, its `generate` the summary's turn."""

    #: The request as the client asked it (its answer's turn is made of it).
    asked: GenerateRequest | None

    def continuation(self) -> GoesOn | None:
        """The prompt the answer goes on from after the summary (None: it ends there)."""
        ...


def resumed(
    request: GenerateRequest, asked: GenerateRequest, messages: tuple[Message, ...]
) -> GenerateRequest:
    """The answer's turn after the summary: `request` (the summary's turn as the fleet
    was given it) with what the client `asked` for its answer, and `messages`."""
    return replace(
        request,
        messages=messages,
        tool_choice=asked.tool_choice,
        response_format=asked.response_format,
        stop=asked.stop,
    )


#: Hears that a summary's turn ended: whether it wrote a summary (the metrics').
Recorder = Callable[[bool], None]


def compaction_start(
    request: GenerateRequest,
    asked: GenerateRequest,
    goes_on: GoesOn | None,
    start: Coroutine[Any, Any, tuple[Started, UpstreamCall]],
    start_turn: StartTurn,
    deadline: Deadline,
    record: Recorder,
) -> Coroutine[Any, Any, tuple[Started, UpstreamCall]]:
    """The start of a compacting answer for the route's pump, from its summary turn's
    `start` (`request`, as the fleet was given it; `asked`: the request as parsed;
    `goes_on` None: the answer ends after the summary)."""

    async def begin() -> tuple[Started, UpstreamCall]:
        started, call = await start
        turns = CompactionTurns(
            request, asked, goes_on, started, call, start_turn, deadline, record
        )
        return started, turns

    return begin()


class CompactionTurns:
    """The summary's turn, then (unless paused) the answer's, as one call."""

    def __init__(
        self,
        request: GenerateRequest,
        asked: GenerateRequest,
        goes_on: GoesOn | None,
        started: Started,
        call: UpstreamCall,
        start_turn: StartTurn,
        deadline: Deadline,
        record: Recorder,
    ) -> None:
        self._request = request
        self._asked = asked
        self._goes_on = goes_on
        self._started = started
        self._call = call
        self.worker = call.worker
        self._start_turn = start_turn
        self._deadline = deadline
        self._record = record
        self._events = self._run()

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        # the API's encoder reads `Compacted` too; the pump passes it on
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

    async def _run(self) -> AsyncIterator[Event | Compacted]:
        finished, texts = await self._ended()
        summary = "".join(texts).strip() or None
        self._record(summary is not None)
        prompt, cached = turn_counts(self._started, finished)
        written = finished.completion_tokens
        goes_on = self._goes_on
        yield Compacted(summary, prompt, written, cached, goes_on is None)
        if goes_on is None:
            yield Finished(FinishReason.STOP, written, prompt, cached_tokens=cached)
            return
        if self._deadline.remaining() <= 0:
            raise errors.Timeout("The answer's turns took longer than the request may.")
        asked = self._asked
        messages = (asked.messages or ()) if summary is None else goes_on(summary)
        self._started, self._call = await self._start_turn(resumed(self._request, asked, messages))
        self.worker = self._call.worker
        async for event in self._call:
            if type(event) is Finished:
                turn_prompt, turn_cached = turn_counts(self._started, event)
                self._call.close()
                yield event._replace(
                    completion_tokens=written + event.completion_tokens,
                    prompt_tokens=prompt + turn_prompt,
                    cached_tokens=cached + turn_cached,
                )
                return
            yield event
        raise errors.Failed("The engine worker ended the answer without its end.")
