"""OpenAI's Conversations API (`/v1/conversations`), as the openai SDK's
`client.conversations` and the Agents SDK's `OpenAIConversationsSession` use it: a
conversation (`conv_...`) holds items that a Responses turn naming it (`conversation`)
reads before its input and extends with its input and output (routes.py), and that a
client reads, adds and deletes here:

    POST   /v1/conversations                        create (`items`: up to 20; `metadata`)
    GET    /v1/conversations/{id}                   retrieve
    POST   /v1/conversations/{id}                   update its `metadata`
    DELETE /v1/conversations/{id}                   delete (`conversation.deleted`)
    GET    /v1/conversations/{id}/items             a page (`limit`, `order`, `after`)
    POST   /v1/conversations/{id}/items             add up to 20 items (a list of them)
    GET    /v1/conversations/{id}/items/{item_id}   one item
    DELETE /v1/conversations/{id}/items/{item_id}   delete one (the conversation)

Items are the Responses API's input items, checked by its parser (params.py: a 400
names `items[i]...`) and kept as its store keeps them, with their ids. `include` asks
for nothing these items lack, and is refused by name, as the store's reads refuse it.
The team's own conversations only (conversation_store.py): another team's is a 404.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, cast

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.edge.asgi import Receive, Scope
from gateway.edge.errors import APIError, invalid
from gateway.edge.openai.body import parse_json, read_body
from gateway.edge.responses.conversation_store import (
    ConversationStore,
    Full,
    kept_item,
    not_found,
)
from gateway.edge.responses.params import Item, _metadata, input_items, new_id
from gateway.edge.responses.routes import (
    Endpoint,
    Page,
    guarded,
    json_response,
    refuse_query,
    team_name,
)
from gateway.teams import team_of

CONVERSATIONS = "/v1/conversations"
#: OpenAI's bound on the items one request adds (a creation's, an `items.create`'s).
MAX_ADDED = 20


def _items(body: Mapping[str, Any], required: bool) -> list[Item]:
    """`items`: up to `MAX_ADDED`, at least one where `required`, in the stored form."""
    value = body.get("items")
    if value is None and not required:
        return []
    if not isinstance(value, list) or len(value) > MAX_ADDED or (required and not value):
        least = 1 if required else 0
        raise invalid("items", f"Invalid 'items': expected a list of {least} to {MAX_ADDED} items.")
    return [kept_item(item) for item in input_items(value, "items")]


def _list(items: list[Item]) -> dict[str, Any]:
    """Items as a whole list object (what an `items.create` answers)."""
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": False,
    }


def conversation_routes(
    store: ConversationStore, retry_after: int, max_body_bytes: int
) -> list[Route]:
    """The Conversations API's routes on `store`."""

    guard = guarded(retry_after)

    async def body_of(request: Request) -> Mapping[str, Any]:
        receive = cast(Receive, request.receive)  # Starlette's types say MutableMapping
        raw = await read_body(cast(Scope, request.scope), receive, max_body_bytes)
        body = parse_json(raw) if raw else {}
        if not isinstance(body, dict):
            raise invalid(None, "The request body must be a JSON object.")
        return body

    def ids(request: Request) -> tuple[str, str]:
        return team_name(team_of(request.scope)), request.path_params["conversation_id"]

    async def found(team: str, conversation_id: str) -> dict[str, Any]:
        conversation = await store.get(team, conversation_id)
        if conversation is None:
            raise not_found(conversation_id)
        return conversation

    async def listed(team: str, conversation_id: str) -> list[Item]:
        items = await store.items(team, conversation_id)
        if items is None:
            raise not_found(conversation_id)
        return items

    def too_many(held: int, adding: int) -> APIError:
        return invalid(
            "items",
            f"Invalid 'items': the conversation holds {held} items; with {adding} more it "
            f"would hold more than {store.max_items}.",
        )

    async def create(request: Request) -> Response:
        refuse_query(request)
        body = await body_of(request)
        items = _items(body, required=False)
        if len(items) > store.max_items:
            raise too_many(0, len(items))
        conversation = {
            "id": new_id("conv"),
            "object": "conversation",
            "created_at": int(time.time()),
            "metadata": _metadata(body),
        }
        await store.create(team_name(team_of(request.scope)), conversation, items)
        return json_response(conversation)

    async def one(request: Request) -> Response:
        refuse_query(request)
        team, conversation_id = ids(request)
        if request.method == "GET":
            return json_response(await found(team, conversation_id))
        if request.method == "DELETE":
            if not await store.delete(team, conversation_id):
                raise not_found(conversation_id)
            deleted = {"id": conversation_id, "object": "conversation.deleted", "deleted": True}
            return json_response(deleted)
        body = await body_of(request)
        if "metadata" not in body:
            raise invalid("metadata", "'metadata' is required: an object, or null for none.")
        updated = await store.update(team, conversation_id, _metadata(body))
        if updated is None:
            raise not_found(conversation_id)
        return json_response(updated)

    async def items(request: Request) -> Response:
        team, conversation_id = ids(request)
        if request.method == "GET":
            page = Page.of(request)
            return page.answer(await listed(team, conversation_id))
        refuse_query(request)
        added = _items(await body_of(request), required=True)
        try:
            if not await store.append(team, conversation_id, added, store.max_items):
                raise not_found(conversation_id)
        except Full as full:
            raise too_many(full.held, len(added)) from None
        return json_response(_list(added))

    async def item(request: Request) -> Response:
        refuse_query(request)
        team, conversation_id = ids(request)
        item_id = request.path_params["item_id"]
        if request.method == "GET":
            kept = await listed(team, conversation_id)
            match = next((it for it in kept if it["id"] == item_id), None)
        else:
            gone = await store.delete_item(team, conversation_id, item_id)
            if gone is None:
                raise not_found(conversation_id)
            match = await found(team, conversation_id) if gone else None
        if match is None:
            raise APIError(
                404, f"Item with id '{item_id[:128]}' not found.", param="item_id", code="not_found"
            )
        return json_response(match)

    handlers: list[tuple[str, Endpoint, list[str]]] = [
        (CONVERSATIONS, create, ["POST"]),
        (CONVERSATIONS + "/{conversation_id}", one, ["GET", "POST", "DELETE"]),
        (CONVERSATIONS + "/{conversation_id}/items", items, ["GET", "POST"]),
        (CONVERSATIONS + "/{conversation_id}/items/{item_id}", item, ["GET", "DELETE"]),
    ]
    return [Route(path, guard(handler), methods=methods) for path, handler, methods in handlers]
