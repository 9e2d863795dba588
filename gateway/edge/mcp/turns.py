"""The turns of one answer whose tools include remote MCP servers (servers.py; the
Responses API's `mcp` tools, Anthropic's MCP connector): one call to the fleet a turn,
the MCP calls the model makes run between them, all of it one stream of events for the
route's encoder, as one worker call would give it.

`McpTurns` is the call the route's event pump reads (an `UpstreamCall`): it gives the
listings first (`McpListed`), runs the calls the client approved in this request's input,
then relays the first turn's events, but for the pieces of calls of MCP tools, which it
gathers. A turn that ends with such calls: each that needs approval becomes an
`McpApproval` and the answer ends there (the client approves in its next request); the
others run one after another (`McpCallStarted`, then `McpCallEnded` with the output or
the error), and the next turn starts with the conversation grown by the assistant's
calls and their outputs. A turn that also called the client's own functions ends the
answer after its MCP calls ran: those are the client's to run. At most `max_calls`
MCP calls run in one answer (`max_tool_calls`, else `MAX_CALLS`); past it the model
answers without tools (its `tool_choice` becomes "none"). The last `Finished` carries the
turns' tokens added up, each turn's prompt counted, as OpenAI counts them.

The slot, the deadline and the client's leaving are the request's: a client that leaves
cancels the turn in flight or the MCP step under way (`cancel`), and a step with a
server waits no longer than `mcp_timeout` nor than the deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, cast

import orjson

from gateway.edge.errors import invalid
from gateway.edge.mcp.servers import (
    McpFailure,
    McpServer,
    McpTool,
    StepRecorder,
    call_tool,
    list_tools,
)
from gateway.protocol import errors
from gateway.protocol.deadline import Deadline
from gateway.protocol.types import (
    Event,
    Finished,
    FinishReason,
    GenerateRequest,
    Message,
    Reasoning,
    Started,
    Text,
    Tool,
    ToolCall,
    ToolCallDelta,
    turn_counts,
)
from gateway.upstreams.base import CANCELLED, CallEnd, UpstreamCall

#: MCP calls run in one answer at most when the request does not say (`max_tool_calls`).
MAX_CALLS = 32


class McpListed(NamedTuple):
    """A server's tools, listed for this answer (an `mcp_list_tools` item)."""

    label: str
    tools: tuple[McpTool, ...]


class McpCallStarted(NamedTuple):
    """An MCP call that runs now (an `mcp_call` item, in progress)."""

    label: str
    name: str
    arguments: str
    approval_request_id: str | None = None
    #: The model's id of the call (an Anthropic `mcp_tool_use` block's).
    call_id: str = ""


class McpCallEnded(NamedTuple):
    """The call started last ended: its output, or its error."""

    output: str | None
    error: str | None


class McpApproval(NamedTuple):
    """A call that waits for the client's approval (an `mcp_approval_request` item)."""

    label: str
    name: str
    arguments: str


@dataclass
class Approved:
    """A call the client approved in this request's input: run before the first turn."""

    request_id: str
    label: str
    name: str
    arguments: str


@dataclass
class McpPlan:
    """What a request's MCP tools need of its answer."""

    servers: dict[str, McpServer]
    #: The tools the model may call, by name: (their server, the tool).
    tools: dict[str, tuple[McpServer, McpTool]]
    #: Listings made for this answer (a conversation that holds one lists no more).
    listed: list[McpListed] = field(default_factory=list)
    approved: list[Approved] = field(default_factory=list)
    max_calls: int = MAX_CALLS
    #: Where each step with a server is counted (the telemetry's `mcp_step`), and its
    #: span (the tracing's `tool_step`: none without tracing).
    record: StepRecorder = field(default=lambda *_: None)
    span: StepSpan = field(default=lambda *_: nullcontext())

    def functions(self) -> list[Tool]:
        """The servers' tools as the model sees them: functions by their names."""
        return [
            Tool(name, tool.description, orjson.dumps(tool.input_schema).decode())
            for name, (_, tool) in self.tools.items()
        ]


class ListingFailed(Exception):
    """A server's tools could not be listed: each API says so in its own words."""

    def __init__(self, server: McpServer, failure: McpFailure) -> None:
        super().__init__(str(failure))
        self.server = server


async def make_plan(
    servers: Sequence[McpServer],
    listed: Mapping[str, tuple[McpTool, ...]],
    functions: Sequence[str],
    max_calls: int,
    timeout: float,  # noqa: ASYNC109 (a step's bound, within the request's deadline)
    record: StepRecorder,
    span: StepSpan,
) -> McpPlan:
    """What `servers` need of an answer: each server's tools, as the conversation last
    listed them (`listed`, by label) or listed now (`ListingFailed` when it cannot be); a
    tool named as one of the request's `functions` or another server's is a 400 naming
    its server (`where`)."""
    plan = McpPlan({server.label: server for server in servers}, {}, max_calls=max_calls)
    plan.record, plan.span = record, span
    fresh = [server for server in servers if server.label not in listed]

    async def listing(server: McpServer) -> list[McpTool]:
        began = time.perf_counter()
        with span("list", server.prefix, ""):
            try:
                tools = await list_tools(server, timeout)
            except McpFailure:
                record(server.prefix, "list", False, time.perf_counter() - began)
                raise
        record(server.prefix, "list", True, time.perf_counter() - began)
        return tools

    found = await asyncio.gather(*(listing(server) for server in fresh), return_exceptions=True)
    known = dict(listed)
    for server, tools in zip(fresh, found, strict=True):
        if isinstance(tools, McpFailure):
            raise ListingFailed(server, tools)
        if isinstance(tools, BaseException):
            raise tools
        known[server.label] = tuple(tools)
        plan.listed.append(McpListed(server.label, tuple(tools)))
    taken = set(functions)
    for server in servers:
        for tool in known[server.label]:
            if not server.offers(tool.name):
                continue
            if tool.name in taken:
                raise invalid(
                    server.where,
                    f"The MCP server '{server.label}' lists a tool named {tool.name!r}, as "
                    "another tool of the request is named.",
                )
            taken.add(tool.name)
            plan.tools[tool.name] = (server, tool)
    return plan


def turns_start(
    plan: McpPlan,
    request: GenerateRequest,
    start: Coroutine[Any, Any, tuple[Started, UpstreamCall]],
    start_turn: StartTurn,
    started: bool,
    deadline: Deadline,
    step_timeout: float,
) -> Coroutine[Any, Any, tuple[Started, UpstreamCall]]:
    """The start of an answer's turns for the route's pump, from its first turn's
    `start` (`started`: already under way, as a fallback's choice starts it): with calls
    approved, the first turn waits for their outputs, so `start` is dropped (stopped, if
    under way) and the answer's head is a `Started` of its own."""

    async def begin() -> tuple[Started, UpstreamCall]:
        first = None
        if not plan.approved:
            first = await start
        elif not started:
            start.close()  # never started: the first turn waits for the approved calls
        else:
            (await start)[1].cancel()
        turns = McpTurns(plan, request, start_turn, first, deadline, step_timeout)
        return (first[0] if first is not None else Started(0)), turns

    return begin()


@dataclass
class _Pending:
    """A call of an MCP tool gathered from a turn's pieces."""

    id: str
    name: str
    arguments: list[str] = field(default_factory=list)


#: A step's span: (the step, the server's allowed prefix, the tool's name) → a context
#: manager of the span (None without tracing).
StepSpan = Callable[[str, str, str], AbstractContextManager[Any]]
#: What the route's encoder reads: the worker's events and the MCP steps'.
TurnEvent = Event | McpListed | McpCallStarted | McpCallEnded | McpApproval
StartTurn = Callable[[GenerateRequest], Awaitable[tuple[Started, UpstreamCall]]]


class McpTurns:
    """The answer's turns as one call (see the module's docstring)."""

    def __init__(
        self,
        plan: McpPlan,
        request: GenerateRequest,
        start_turn: StartTurn,
        first: tuple[Started, UpstreamCall] | None,
        deadline: Deadline,
        step_timeout: float,
    ) -> None:
        self.plan = plan
        self.request = request
        self._start_turn = start_turn
        self._deadline = deadline
        self._step_timeout = step_timeout
        self._prompt = self._cached = self._completion = self._calls = 0
        # the turn in flight, and its start (an end that counts wins: `turn_counts`)
        self._call: UpstreamCall | None = None
        self._turn_started = Started(0)
        self.worker = ""
        if first is not None:
            self._began(*first)
        self._events = self._run()

    def _began(self, started: Started, call: UpstreamCall) -> None:
        self._call, self.worker = call, call.worker
        self._turn_started = started

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        # the encoder of this API reads the MCP events too; the pump passes them on
        return cast(Event, await self._events.__anext__())

    def cancel(self, outcome: CallEnd = CANCELLED) -> None:
        if self._call is not None:
            self._call.cancel(outcome)

    def close(self, outcome: CallEnd = None) -> None:
        if self._call is not None:
            self._call.close(outcome)

    async def _step(self, server: McpServer, name: str, arguments: str) -> McpCallEnded:
        timeout = min(self._step_timeout, self._deadline.remaining())
        began = time.perf_counter()
        with self.plan.span("call", server.prefix, name) as span:
            output, error = await call_tool(server, name, arguments, timeout)
            if error is not None and span is not None:
                span.set_attribute("error.type", "tool_error")
        self.plan.record(server.prefix, "call", error is None, time.perf_counter() - began)
        return McpCallEnded(output, error)

    async def _run(self) -> AsyncIterator[TurnEvent]:
        plan, request = self.plan, self.request
        messages = list(request.messages or ())
        for listed in plan.listed:
            yield listed
        for approved in plan.approved:
            yield McpCallStarted(
                approved.label,
                approved.name,
                approved.arguments,
                approved.request_id,
                approved.request_id,
            )
            ended = await self._step(
                plan.servers[approved.label], approved.name, approved.arguments
            )
            yield ended
            messages.append(Message("tool", _told(ended), tool_call_id=approved.request_id))
        if self._call is None:  # the first turn waits for the approved calls' outputs
            await self._next_turn(request, messages)
        while True:
            assert self._call is not None
            said: list[str] = []
            thought: list[str] = []
            pending: dict[int, _Pending] = {}
            others = False
            finished: Finished | None = None
            async for event in self._call:
                kind = type(event)
                if kind is ToolCallDelta:
                    assert isinstance(event, ToolCallDelta)
                    piece = pending.get(event.call_index)
                    if piece is not None or event.name in plan.tools:
                        if piece is None:
                            piece = pending[event.call_index] = _Pending(event.id, event.name)
                        piece.arguments.append(event.arguments)
                        continue
                    others = True
                elif kind is Finished:
                    assert isinstance(event, Finished)
                    finished = event
                    break
                elif kind is Text:
                    said.append(event.text)  # type: ignore[union-attr]
                elif kind is Reasoning:
                    thought.append(event.text)  # type: ignore[union-attr]
                yield event
            self._call.close()
            if finished is None:
                raise errors.Failed("The engine worker ended the answer without its end.")
            self._count(finished)
            if not pending:
                yield self._end(finished.reason)
                return
            calls = [
                ToolCall(p.id or f"call_{i}", p.name, "".join(p.arguments))
                for i, p in enumerate(pending.values())
            ]
            messages.append(
                Message(
                    "assistant", "".join(said), tool_calls=tuple(calls), reasoning="".join(thought)
                )
            )
            asked = [call for call in calls if plan.tools[call.name][0].needs_approval(call.name)]
            for call in calls:
                if call in asked:
                    continue
                server = plan.tools[call.name][0]
                if self._calls >= plan.max_calls:
                    ended = McpCallEnded(None, "Not run: the answer's tool calls are spent.")
                else:
                    self._calls += 1
                    yield McpCallStarted(server.label, call.name, call.arguments, None, call.id)
                    ended = await self._step(server, call.name, call.arguments)
                    yield ended
                messages.append(Message("tool", _told(ended), tool_call_id=call.id))
            if asked:  # the client approves (or not) in its next request
                for call in asked:
                    yield McpApproval(plan.tools[call.name][0].label, call.name, call.arguments)
                yield self._end(FinishReason.TOOL_CALLS)
                return
            if others:  # the client's own functions were called too: theirs to run
                yield self._end(FinishReason.TOOL_CALLS)
                return
            spent = self._calls >= plan.max_calls
            await self._next_turn(
                replace(request, tool_choice="none") if spent else request, messages
            )

    async def _next_turn(self, request: GenerateRequest, messages: Sequence[Message]) -> None:
        if self._deadline.remaining() <= 0:
            raise errors.Timeout("The answer's turns took longer than the request may.")
        self._began(*await self._start_turn(replace(request, messages=tuple(messages))))

    def _count(self, finished: Finished) -> None:
        """Adds a turn's tokens to the answer's."""
        self._completion += finished.completion_tokens
        prompt, cached = turn_counts(self._turn_started, finished)
        self._prompt += prompt
        self._cached += cached

    def _end(self, reason: FinishReason) -> Finished:
        return Finished(reason, self._completion, self._prompt, cached_tokens=self._cached)


def _told(ended: McpCallEnded) -> str:
    """What the model reads of a call: its output, or its error."""
    if ended.error is not None:
        return f"Error: {ended.error}"
    return ended.output or ""
