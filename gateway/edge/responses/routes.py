"""The Responses API's routes: `POST /v1/responses` is the generation route of chat
completions (`gateway.edge.openai.generation`) with this API's parser and encoder, so
it takes the same admission, slots, deadlines, cancellation, limits, metrics, access
log and traces; `GET /v1/responses/{id}`, `GET /v1/responses/{id}/input_items` and
`DELETE /v1/responses/{id}` read the store (store.py), the caller's team's only;
`POST /v1/responses/input_tokens` counts the prompt of a body as this route reads it
(input_tokens.py).

What this route adds to the generation route: before admission, an `item_reference`
reads the output item it names from the stored response that holds it, and a continuation
(`previous_response_id`) reads its conversation from the store, bounded in depth
(`responses_max_depth`, a 400 naming `previous_response_id`) and in items
(`max_messages`, a 400 naming `input`); it carries the conversation's session key (the
first turn's id, or the client's `prompt_cache_key`) so that the fleet's session
affinity keeps a conversation on the worker that holds its prefix. A turn of a
conversation (`conversation`: conversation_store.py) reads its items in the same place,
bounded by `conversations_max_items` (a 400 naming `conversation`), its id the session
key. After the answer, a stored response (`store`, true by default) is written, and a
conversation's turn (its input, then its output) appended to it (`store` or not, as
OpenAI does), before the answer's last bytes go out, so a client that has the answer
can continue from it on any replica.

With `truncation: "auto"`, the prompt is counted in the request's slot, on the pool
that serves it, and items dropped from the conversation's beginning until it fits
(truncation.py: one count for every such request, at most four); a model whose context
is unknown, or whose workers cannot count, refuses it, naming `truncation`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from dataclasses import fields as dataclass_fields
from functools import wraps
from typing import Any, ClassVar

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.edge.asgi import Message as ASGIMessage
from gateway.edge.asgi import Send
from gateway.edge.compacting import GoesOn, summarizing, summary_message
from gateway.edge.counting import prompt_counter
from gateway.edge.errors import APIError, from_error, invalid
from gateway.edge.mcp.routes import planned
from gateway.edge.mcp.turns import MAX_CALLS, ListingFailed, McpPlan
from gateway.edge.openai.generation import GenerationRoute
from gateway.edge.openai.input_limits import InputLimits
from gateway.edge.openai.validation import ParsedRequest
from gateway.edge.request import Exchange, Parts, session
from gateway.edge.responses.conversation_store import (
    ConversationStore,
    Full,
    conversation_history,
    kept_item,
)
from gateway.edge.responses.encoding import ResponsesEncoder, encoder_type
from gateway.edge.responses.mcp import (
    APPROVAL_RESPONSE,
    approved_calls,
    listing_failed,
    listings,
)
from gateway.edge.responses.params import (
    LOGPROBS,
    REFERENCE,
    Item,
    ResponsesBody,
    generate_request,
    kept_in_compaction,
    new_id,
    parse,
    prompt_messages,
    referenced_response,
    resolve,
)
from gateway.edge.responses.store import ResponseStore, Stored
from gateway.edge.responses.truncation import fit
from gateway.fleet import ModelPool
from gateway.protocol import errors
from gateway.protocol.types import GenerateRequest, Message
from gateway.teams import Team, team_of

log = logging.getLogger("furnace.responses")

RESPONSES = "/v1/responses"
#: Chat's parameters (as the checks shared with chat name them) → this API's.
CHAT_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}
#: `GET .../input_items`: OpenAI's page size bounds and default.
MAX_PAGE = 100
DEFAULT_PAGE = 20
#: A response's statuses whose turn is added to its conversation.
KEPT = ("completed", "incomplete")
#: The share of the model's context past which `context_management` compacts when its
#: entry names no `compact_threshold`.
COMPACT_SHARE = 0.8


@dataclass(frozen=True, slots=True)
class ResponsesRequest(ParsedRequest):
    """A parsed Responses body with what its answer and its storing need: the body, the
    response's id, the team's name, the conversation before this turn and its depth,
    and the conversation's session key."""

    body: ResponsesBody | None = None
    response_id: str = ""
    team: str = ""
    history: list[Item] = field(default_factory=list)
    depth: int = 1
    session: str = ""


@dataclass(frozen=True, slots=True)
class CompactingRequest(ResponsesRequest):
    """A request whose prompt reached its `context_management` threshold: its answer
    begins with the conversation's summary (gateway/edge/compacting.py), its `generate`
    the summary's turn, `asked` the request as it came; after the summary it goes on
    from `kept` (the instructions and the user's messages) and the summary's message."""

    turns: ClassVar[bool] = True
    asked: GenerateRequest | None = None
    kept: tuple[Message, ...] = ()

    def continuation(self) -> GoesOn:
        """After the summary: the instructions, the user's messages and the summary."""
        return self._goes_on

    def _goes_on(self, summary: str) -> tuple[Message, ...]:
        return (*self.kept, summary_message(summary))


@dataclass(frozen=True, slots=True)
class TurnsRequest(ResponsesRequest):
    """A request whose tools include remote MCP servers: its answer takes turns
    (gateway/edge/mcp/turns.py), as `plan` says."""

    plan: McpPlan | None = None
    turns: ClassVar[bool] = True


def team_name(team: Team | None) -> str:
    return "" if team is None else team.name


def _request(
    body: ResponsesBody,
    request_id: str,
    team: str,
    previous: Stored | None,
    header: str = "",
    conversation: list[Item] | None = None,
) -> ResponsesRequest:
    """The request of a checked body after `previous` or the items of its
    `conversation`: the conversation's session key is the client's `prompt_cache_key`,
    else the one the conversation began with, else its `x-session-id` header, its
    conversation's id or the new response's own id."""
    response_id = new_id("resp")
    if previous is not None:
        history = previous.conversation()
        session = body.session or previous.session
    else:
        history = conversation or []
        session = body.session or header or body.conversation or response_id
    return ResponsesRequest(
        body.model,
        generate_request(body, history, request_id, session),
        body.stream,
        False,
        body=body,
        response_id=response_id,
        team=team,
        history=history,
        depth=1 if previous is None else previous.depth + 1,
        session=session,
    )


def _parse_alone(body: Any, request_id: str) -> ParsedRequest:
    """A body checked without the store (what the generation route's `parse` is): an
    `item_reference` finds nothing."""
    parsed = parse(body)
    return _request(replace(parsed, items=resolve(parsed.items, {})), request_id, "", None)


def not_found(response_id: str) -> APIError:
    """OpenAI's 404 for a response id no store holds."""
    return APIError(
        404,
        f"Response with id '{response_id[:128]}' not found.",
        param="response_id",
        code="not_found",
    )


class ResponsesRoute(GenerationRoute):
    """`POST /v1/responses`."""

    def __init__(
        self,
        parts: Parts,
        limits: InputLimits,
        store: ResponseStore,
        conversations: ConversationStore,
    ) -> None:
        super().__init__(_parse_alone, ResponsesEncoder, parts, limits, CHAT_PARAMS)
        self.store = store
        #: The conversations a turn may name (`conversation_history` reads one).
        self.conversations = conversations
        self.max_depth = parts.config.responses_max_depth
        self.max_items = parts.config.max_messages

    async def parse_body(self, body: Any, ex: Exchange) -> ParsedRequest:
        """The body, its `item_reference`s read from the store, and with
        `previous_response_id` the conversation it continues."""
        parsed = parse(body)
        team = team_name(team_of(ex.scope))
        if any(item["type"] == REFERENCE for item in parsed.items):
            parsed = replace(parsed, items=await self._referenced(team, parsed.items))
        previous = None
        if parsed.previous_response_id is not None:
            previous = await self.store.get(team, parsed.previous_response_id)
            if previous is None:
                raise APIError(
                    404,
                    f"Previous response with id '{parsed.previous_response_id}' not found.",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            if previous.depth >= self.max_depth:
                raise invalid(
                    "previous_response_id",
                    f"The conversation is {previous.depth} turns deep; at most "
                    f"{self.max_depth} are served.",
                )
        conversation = None
        if parsed.conversation is not None:
            conversation = await conversation_history(self.conversations, team, parsed.conversation)
            bound = self.conversations.max_items
            if len(conversation) + len(parsed.items) > bound:
                raise invalid(
                    "conversation",
                    f"Invalid 'conversation': it holds {len(conversation)} items; with this "
                    f"input it would hold more than {bound}.",
                )
        header = session(ex)
        request = _request(parsed, ex.record.request_id, team, previous, header, conversation)
        if len(request.history) + len(parsed.items) > self.max_items:
            raise invalid(
                "input",
                f"Invalid 'input': the conversation would hold more than {self.max_items} items.",
            )
        return request

    async def _referenced(self, team: str, items: tuple[Item, ...]) -> tuple[Item, ...]:
        """The items with each `item_reference` replaced by the output item it names, read
        from the team's stored response that holds it (its id names it: one read a
        response, however many of its items are named); one the team has no stored
        response for is OpenAI's 404, naming it. They name at most `responses_max_depth`
        responses (a 400 naming `input`), as a stored conversation holds no more turns."""
        wanted = {item["id"] for item in items if item["type"] == REFERENCE}
        named = {referenced_response(item_id) for item_id in wanted} - {None}
        if len(named) > self.max_depth:
            raise invalid(
                "input",
                f"Invalid 'input': its item references name {len(named)} responses; at most "
                f"{self.max_depth} are served.",
            )
        found: dict[str, Item] = {}
        for stored in await asyncio.gather(*(self.store.get(team, str(r)) for r in named)):
            if stored is not None:
                found.update((o["id"], o) for o in stored.response["output"] if o["id"] in wanted)
        return resolve(items, found)

    async def prepare(self, ex: Exchange) -> tuple[ParsedRequest, ModelPool]:
        """The generation route's checks; `truncation: "auto"` wants the model's context."""
        parsed, pool = await super().prepare(ex)
        if _truncates(parsed) and not pool.max_context:
            raise no_truncation(
                pool.name,
                "its context length is unknown (its workers do not report it; the model's "
                "`max_model_len` sets it)",
            )
        return parsed, pool

    async def _serve(self, parsed: ParsedRequest, pool: ModelPool, ex: Exchange) -> None:
        """The generation route's; with `truncation: "auto"`, the prompt cut to fit first;
        with remote MCP tools, their tools listed first (in the request's slot)."""
        assert isinstance(parsed, ResponsesRequest)
        if _truncates(parsed):
            parsed = await self._truncated(parsed, pool, ex)
        body = parsed.body
        if body is not None and body.mcp:
            parsed = await self._planned(parsed, pool)
        elif body is not None and any(item["type"] == APPROVAL_RESPONSE for item in body.items):
            # an approval with no server to run its call on is refused
            approved_calls([*parsed.history, *body.items], body.items, set())
        if body is not None and body.compact_threshold is not None:
            parsed = await self._compacting(parsed, pool, ex)
        await super()._serve(parsed, pool, ex)

    async def _compacting(
        self, request: ResponsesRequest, pool: ModelPool, ex: Exchange
    ) -> ResponsesRequest:
        """`request` as a compacting one when its prompt (counted in its slot, on `pool`)
        reaches its `context_management` threshold (by default, `COMPACT_SHARE` of the
        model's context)."""
        body, generate = request.body, request.generate
        assert body is not None and body.compact_threshold is not None
        threshold = body.compact_threshold
        if not threshold:
            if not pool.max_context:
                raise invalid(
                    "context_management[0].compact_threshold",
                    f"'compact_threshold' is required for the model {pool.name}: its context "
                    "length is unknown (its workers do not report it; `max_model_len` sets it).",
                )
            threshold = int(pool.max_context * COMPACT_SHARE)
        assert generate.messages is not None
        try:
            tokens = await prompt_counter(self, ex, pool, generate)(generate.messages)
        except errors.CannotCount:
            raise invalid(
                "context_management",
                f"'context_management' is not supported for the model {pool.name}: its "
                "upstream server cannot count the prompt's tokens.",
            ) from None
        if tokens < threshold:
            return request
        items = [*request.history, *body.items]
        kept = prompt_messages(body.instructions, [i for i in items if kept_in_compaction(i)])
        fields = {f.name: getattr(request, f.name) for f in dataclass_fields(request)}
        summary = summarizing(generate)
        return CompactingRequest(**{**fields, "generate": summary, "asked": generate, "kept": kept})

    async def _planned(self, request: ResponsesRequest, pool: ModelPool) -> TurnsRequest:
        """`request` with its MCP servers' tools given to the model, in its slot, and the
        calls its input approves."""
        body = request.body
        assert body is not None
        items = [*request.history, *body.items]
        max_calls = body.echo.get("max_tool_calls")
        max_calls = MAX_CALLS if max_calls is None else max_calls
        try:
            plan, generate = await planned(
                self, body.mcp, listings(items), request.generate, max_calls, pool
            )
        except ListingFailed as failure:
            raise listing_failed(failure) from None
        plan.approved = approved_calls(items, body.items, set(plan.servers))
        fields = {f.name: getattr(request, f.name) for f in dataclass_fields(request)}
        return TurnsRequest(**{**fields, "generate": generate, "plan": plan})

    async def _truncated(
        self, request: ResponsesRequest, pool: ModelPool, ex: Exchange
    ) -> ResponsesRequest:
        """`request` with its prompt fitted to `pool`'s context (truncation.py), counted
        in its slot where the model's tokenizer is."""
        body = request.body
        assert body is not None
        if not pool.max_context:  # a fallback's model, which did not say its context
            raise no_truncation(pool.name, "its context length is unknown")
        count = prompt_counter(self, ex, pool, request.generate)
        room = body.sampling.max_tokens or 1  # the client's `max_output_tokens`
        items = [*request.history, *body.items]
        try:
            fitted = await fit(body.instructions, items, count, pool.max_context, room)
        except errors.CannotCount:
            raise no_truncation(
                pool.name, "its upstream server cannot count the prompt's tokens"
            ) from None
        if fitted.dropped:
            log.debug(
                "response %s: %d items dropped to fit %s's context (%d tokens, %d counts)",
                request.response_id,
                fitted.dropped,
                pool.name,
                fitted.tokens,
                fitted.counts,
            )
            if self.telemetry.log_prompts:
                ex.record.prompt = fitted.messages
        return replace(request, generate=replace(request.generate, messages=fitted.messages))

    def encoder(self, parsed: ParsedRequest, pool: ModelPool) -> ResponsesEncoder:
        assert isinstance(parsed, ResponsesRequest) and parsed.body is not None
        # padding and logprobs have encoders of their own: a request without runs none of it
        return encoder_type(parsed.body)(pool.name, parsed.body, parsed.response_id, parsed)

    async def _refuse(self, ex: Exchange, error: APIError) -> None:
        """The generation route's refusal; logprobs, which chat asks with `logprobs`,
        are asked here in `include`."""
        if error.param == "logprobs":
            error.param = "include"
            error.message = error.message.replace("'logprobs'", f"logprobs ('{LOGPROBS}')")
        await super()._refuse(ex, error)

    async def _relay_events(
        self,
        pump: Any,
        encoder: Any,
        stream: bool,
        record: Any,
        send: Send,
        gone: asyncio.Future[None],
        write_now: Any = None,
    ) -> None:
        """The generation route's relay, with the response stored and its conversation
        extended before the answer's last bytes go out (a text written at once skips
        `send_kept`: it is never the last)."""
        assert isinstance(encoder, ResponsesEncoder)
        request = encoder.request
        assert isinstance(request, ResponsesRequest) and request.body is not None
        if not request.body.store and request.body.conversation is None:
            await super()._relay_events(pump, encoder, stream, record, send, gone, write_now)
            return

        async def send_kept(message: ASGIMessage) -> None:
            last = message["type"] == "http.response.body" and not message.get("more_body")
            if last and encoder.final is not None:
                await self._keep(request, encoder.final, pump.worker)
            await send(message)

        await super()._relay_events(pump, encoder, stream, record, send_kept, gone, write_now)

    async def _keep(self, request: ResponsesRequest, final: dict[str, Any], worker: str) -> None:
        """The answer stored (`store`), then its turn appended to its conversation: the
        input, then the output, of an answer that stands (completed or incomplete)."""
        assert request.body is not None
        stands = await self._store(request, final, worker) if request.body.store else True
        conversation = request.body.conversation
        if conversation is None or not stands or final["status"] not in KEPT:
            return
        turn = [kept_item(item) for item in (*request.body.items, *final["output"])]
        # the input was within the bound when the turn began; its answer is kept whole
        limit = self.conversations.max_items + len(final["output"])
        why = ""
        try:
            if not await self.conversations.append(request.team, conversation, turn, limit):
                why = "it was deleted"
        except Full:
            why = "it is full (another turn filled it meanwhile)"
        except errors.Unavailable as error:
            why = error.message
        if why:  # the answer is served all the same
            log.warning("response %s not added to %s: %s", final["id"], conversation, why)

    async def _store(self, request: ResponsesRequest, final: dict[str, Any], worker: str) -> bool:
        """Stores the answer; whether it stands (a background one may have ended first)."""
        assert request.body is not None
        stored = Stored(
            final,
            list(request.body.items),
            request.history,
            request.depth,
            worker,
            request.session,
        )
        try:
            await self.store.put(request.team, stored)
        except errors.Unavailable as error:
            # the answer is served all the same; continuing from it will be a 400
            log.warning("response %s not stored: %s", stored.id, error.message)
        return True


def _truncates(parsed: ParsedRequest) -> bool:
    """Whether the request asks `truncation: "auto"`."""
    return isinstance(parsed, ResponsesRequest) and parsed.body is not None and parsed.body.truncate


def no_truncation(model: str, why: str) -> APIError:
    """A 400 for `truncation: "auto"` on a model it cannot be served for, naming it."""
    return invalid(
        "truncation",
        f"'truncation' of 'auto' is not supported for the model {model}: {why}. "
        "Send 'truncation': 'disabled' (the default).",
    )


#: A store route's handler (responses, conversations, batches and their files).
Endpoint = Callable[[Request], Awaitable[Response]]


def guarded(retry_after: int) -> Callable[[Endpoint], Endpoint]:
    """A store route whose store's failure is a 503 (with `retry_after`)."""

    def guard(handler: Endpoint) -> Endpoint:
        @wraps(handler)
        async def guarded_handler(request: Request) -> Response:
            try:
                return await handler(request)
            except errors.GatewayError as error:
                raise from_error(error, retry_after) from None

        return guarded_handler

    return guard


def json_response(value: Any, status: int = 200) -> Response:
    """`value` as the JSON body of a store route's answer."""
    return Response(orjson.dumps(value), status, media_type="application/json")


def refuse_query(request: Request, served: tuple[str, ...] = ()) -> None:
    """Query parameters of OpenAI's that ask what is not served, refused by name; a
    list's `name[]` (as the SDK sends `include`) is `name`."""
    for raw, value in request.query_params.multi_items():
        name = raw.removesuffix("[]")
        if name in served:
            continue
        if name == "include" and not value:
            continue
        if name == "include_obfuscation":  # it shapes a stream alone (a resumed one as kept)
            if value not in ("true", "false", ""):
                raise invalid(name, f"Invalid value for '{name}': expected a boolean.")
            continue
        if name in ("include", "stream", "starting_after") and value not in ("false", ""):
            raise invalid(name, f"'{name}' is not supported by this gateway.")


@dataclass(frozen=True, slots=True)
class Page:
    """A list of items' page, as its query asks it (OpenAI's `limit`, `order`, `after`):
    a response's input items, a conversation's items."""

    limit: int
    order: str
    after: str | None

    @classmethod
    def of(cls, request: Request) -> Page:
        """The query's page, or a 400 naming the parameter (anything else asked, too)."""
        refuse_query(request, ("after", "limit", "order"))
        # a `name[]` is `name`, as `refuse_query` reads it (the last one given wins)
        query = {k.removesuffix("[]"): v for k, v in request.query_params.multi_items()}
        try:
            limit = int(query.get("limit", DEFAULT_PAGE))
        except ValueError:
            raise invalid("limit", "Invalid 'limit': an integer from 1 to 100.") from None
        if not 1 <= limit <= MAX_PAGE:
            raise invalid("limit", "Invalid 'limit': an integer from 1 to 100.")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise invalid("order", "Invalid 'order': asc or desc.")
        return cls(limit, order, query.get("after"))

    def answer(self, items: list[Item]) -> Response:
        """The page of `items` (in their order, oldest first) as a list object."""
        if self.order == "desc":
            items = items[::-1]
        if self.after is not None:
            at = next((i for i, item in enumerate(items) if item["id"] == self.after), None)
            if at is None:
                raise invalid("after", f"No item with id '{self.after[:128]}'.")
            items = items[at + 1 :]
        page = items[: self.limit]
        return json_response(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(items) > self.limit,
            }
        )


def store_routes(
    store: ResponseStore,
    retry_after: int,
    resume: Callable[[Request], Awaitable[Response]] | None = None,
    deleted: Callable[[str, str], Awaitable[None]] | None = None,
) -> list[Route]:
    """The store's routes: retrieve, delete, input items; `resume` serves a retrieve
    with `stream=true` (a background stream's events: background.py), and `deleted`
    hears of each response deleted (team, id: a background run of it stops)."""

    async def stored(request: Request) -> Stored:
        response_id = request.path_params["response_id"]
        try:
            found = await store.get(team_name(team_of(request.scope)), response_id)
        except errors.GatewayError as error:  # the store failed: a 503
            raise from_error(error, retry_after) from None
        if found is None:
            raise not_found(response_id)
        return found

    async def one(request: Request) -> Response:
        if request.method == "DELETE":
            response_id = request.path_params["response_id"]
            team = team_name(team_of(request.scope))
            try:
                if not await store.delete(team, response_id):
                    raise not_found(response_id)
                if deleted is not None:
                    await deleted(team, response_id)
            except errors.GatewayError as error:
                raise from_error(error, retry_after) from None
            return json_response({"id": response_id, "object": "response", "deleted": True})
        if resume is not None and request.query_params.get("stream") == "true":
            return await resume(request)
        refuse_query(request)
        return json_response((await stored(request)).response)

    async def input_items(request: Request) -> Response:
        page = Page.of(request)
        return page.answer((await stored(request)).input)

    endpoint = Callable[[Request], Awaitable[Response]]
    handlers: list[tuple[str, endpoint, list[str]]] = [
        (RESPONSES + "/{response_id}", one, ["GET", "DELETE"]),
        (RESPONSES + "/{response_id}/input_items", input_items, ["GET"]),
    ]
    return [Route(path, handler, methods=methods) for path, handler, methods in handlers]
