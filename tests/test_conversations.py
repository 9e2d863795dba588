"""Specs: OpenAI's Conversations API (`/v1/conversations`) and the Responses API's
`conversation`, through the official `openai` SDK (its answers checked against the
SDK's own models) and the Agents SDK's `OpenAIConversationsSession`, against the real
gateway and its demo worker: create, retrieve, update, delete; items listed in pages,
added, read and deleted; a Responses turn that reads a conversation and is appended
to it, whole and streamed, stored or not, in the background too; one team never seeing
another's; the bounds; appends at once; and two replicas sharing a real Redis.

The demo echoes the last message's words, one token per word, and its prompt counts
the words of every message (`gateway.worker.demo`)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
import pytest
from agents import (
    Agent,
    OpenAIConversationsSession,
    OpenAIResponsesModel,
    Runner,
    set_tracing_disabled,
)
from openai.types.conversations import (
    Conversation,
    ConversationDeletedResource,
    ConversationItem,
    ConversationItemList,
)
from pydantic import TypeAdapter

from gateway.edge.responses import store as store_module
from gateway.edge.responses.conversation_store import MemoryConversations
from tests.support.clients import async_openai_sdk, openai_sdk
from tests.support.keys import keyed, new_key
from tests.support.requests import assert_openai_error
from tests.support.servers import DEMO_MODEL
from tests.support.waiting import HANG_GUARD

ITEM = TypeAdapter(ConversationItem)


def _user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


def _texts(items) -> list[str]:
    return [item.content[0].text for item in items]


# -- the objects ------------------------------------------------------------------------


def test_a_conversation_is_created_read_updated_and_deleted(api, client):
    created = api.conversations.create(
        items=[_user("hello there"), {"role": "assistant", "content": "hi"}],
        metadata={"topic": "greeting"},
    )
    assert created.id.startswith("conv_") and created.object == "conversation"
    assert created.metadata == {"topic": "greeting"} and abs(created.created_at - time.time()) < 60
    raw = client.get(f"/v1/conversations/{created.id}").json()
    assert Conversation.model_validate(raw) == created
    updated = api.conversations.update(created.id, metadata={"topic": "weather"})
    assert updated.metadata == {"topic": "weather"}
    assert api.conversations.retrieve(created.id).metadata == {"topic": "weather"}
    # the SDK's own models, validated (not only constructed) from the wire
    listed = client.get(f"/v1/conversations/{created.id}/items?order=asc").json()
    page = ConversationItemList.model_validate(listed)
    assert [item.role for item in page.data] == ["user", "assistant"]
    user, assistant = page.data
    assert user.type == "message" and user.id.startswith("msg_") and user.status == "completed"
    assert user.content[0].type == "input_text" and assistant.content[0].type == "output_text"
    deleted = client.delete(f"/v1/conversations/{created.id}").json()
    assert ConversationDeletedResource.model_validate(deleted).deleted is True
    assert deleted == {"id": created.id, "object": "conversation.deleted", "deleted": True}
    for call in (
        lambda: api.conversations.retrieve(created.id),
        lambda: api.conversations.delete(created.id),
        lambda: api.conversations.update(created.id, metadata={}),
        lambda: api.conversations.items.list(created.id),
    ):
        with pytest.raises(openai.NotFoundError) as missing:
            call()
        assert missing.value.body["code"] == "not_found"


def test_a_conversation_made_without_items_or_metadata(api, client):
    created = api.conversations.create()
    assert created.metadata == {} and not api.conversations.items.list(created.id).data
    answer = client.post(
        "/v1/conversations", content=b"", headers={"content-type": "application/json"}
    )
    assert answer.status_code == 200 and answer.json()["object"] == "conversation"


def test_items_are_added_read_and_deleted(api, client):
    conversation = api.conversations.create(items=[_user("first")])
    added = api.conversations.items.create(
        conversation.id,
        items=[
            {"type": "message", "id": "msg_mine", "role": "user", "content": "second"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "done"},
        ],
    )
    assert [item.type for item in added.data] == [
        "message",
        "function_call",
        "function_call_output",
    ]
    assert added.data[0].id == "msg_mine" and added.first_id == "msg_mine"
    assert added.last_id == added.data[-1].id and not added.has_more
    one = client.get(f"/v1/conversations/{conversation.id}/items/msg_mine").json()
    assert ITEM.validate_python(one).content[0].text == "second"
    assert api.conversations.items.retrieve("msg_mine", conversation_id=conversation.id).id == (
        "msg_mine"
    )
    after = api.conversations.items.delete("msg_mine", conversation_id=conversation.id)
    assert isinstance(after, Conversation) and after.id == conversation.id
    kinds = [i.type for i in api.conversations.items.list(conversation.id, order="asc").data]
    assert kinds == ["message", "function_call", "function_call_output"]
    for call in (
        lambda: api.conversations.items.retrieve("msg_mine", conversation_id=conversation.id),
        lambda: api.conversations.items.delete("msg_mine", conversation_id=conversation.id),
    ):
        with pytest.raises(openai.NotFoundError) as missing:
            call()
        assert missing.value.body["param"] == "item_id"


def test_items_are_listed_in_pages(api, client):
    conversation = api.conversations.create(items=[_user(f"w{i}") for i in range(5)])
    newest = api.conversations.items.list(conversation.id, limit=2)
    assert _texts(newest.data) == ["w4", "w3"] and newest.has_more
    rest = api.conversations.items.list(conversation.id, limit=2, after=newest.last_id)
    assert _texts(rest.data) == ["w2", "w1"] and rest.has_more
    oldest = api.conversations.items.list(conversation.id, order="asc", limit=20)
    assert _texts(oldest.data) == [f"w{i}" for i in range(5)] and not oldest.has_more
    # the SDK's iterator follows the pages to the end
    assert _texts(api.conversations.items.list(conversation.id, limit=2)) == [
        f"w{i}" for i in reversed(range(5))
    ]
    base = f"/v1/conversations/{conversation.id}/items"
    for query, param in (
        ("limit=0", "limit"),
        ("limit=101", "limit"),
        ("order=up", "order"),
        ("after=nope", "after"),
        ("include[]=message.output_text.logprobs", "include"),
    ):
        answer = client.get(f"{base}?{query}")
        assert answer.status_code == 400, query
        assert assert_openai_error(answer)["param"] == param


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("create", {"items": [_user("x")] * 21}, "items"),
        ("create", {"items": "hello"}, "items"),
        ("create", {"items": [{"type": "web_search_call"}]}, "items[0].type"),
        ("create", {"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ("create", {"metadata": {"k": "v" * 513}}, "metadata"),
        ("add", {"items": []}, "items"),
        ("add", {"items": [_user("x")] * 21}, "items"),
        ("add", {"items": [{"role": "robot", "content": "x"}]}, "items[0].role"),
        ("update", {}, "metadata"),
        ("update", {"metadata": {"k": 1}}, "metadata"),
    ],
)
def test_bad_bodies_are_refused_by_name(api, client, route, body, param):
    conversation = api.conversations.create()
    url = {
        "create": "/v1/conversations",
        "add": f"/v1/conversations/{conversation.id}/items",
        "update": f"/v1/conversations/{conversation.id}",
    }[route]
    answer = client.post(url, json=body)
    assert answer.status_code == 400, answer.text
    assert assert_openai_error(answer)["param"] == param


# -- the Responses API's conversation -------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_turn_reads_its_conversation_and_is_appended_to_it(api, stream):
    conversation = api.conversations.create(items=[_user("one two")])

    def turn(text: str, **extra: Any):
        if not stream:
            return api.responses.create(
                model=DEMO_MODEL, input=text, conversation=conversation.id, **extra
            )
        with api.responses.stream(
            model=DEMO_MODEL, input=text, conversation={"id": conversation.id}, **extra
        ) as events:
            return events.get_final_response()

    first = turn("three four five")
    assert first.output_text == "three four five"
    assert first.conversation is not None and first.conversation.id == conversation.id
    assert first.usage.input_tokens == 2 + 3  # the conversation's words, then this input's
    # an unstored turn is appended all the same, as OpenAI does
    second = turn("six", store=False)
    assert second.usage.input_tokens == 2 + 3 + 3 + 1
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(second.id)
    items = api.conversations.items.list(conversation.id, order="asc").data
    assert [(item.role, item.content[0].text) for item in items] == [
        ("user", "one two"),
        ("user", "three four five"),
        ("assistant", "three four five"),
        ("user", "six"),
        ("assistant", "six"),
    ]
    assert items[2].id == first.output[0].id and items[2].status == "completed"
    # a stored turn of a conversation continues by previous_response_id as any other
    third = api.responses.create(model=DEMO_MODEL, input="seven", previous_response_id=first.id)
    assert third.usage.input_tokens == 2 + 3 + 3 + 1 and third.conversation is None


def test_a_turn_names_its_conversation_alone(api, client):
    conversation = api.conversations.create()
    first = api.responses.create(model=DEMO_MODEL, input="a")
    both = {
        "model": DEMO_MODEL,
        "input": "b",
        "conversation": conversation.id,
        "previous_response_id": first.id,
    }
    answer = client.post("/v1/responses", json=both)
    assert answer.status_code == 400 and assert_openai_error(answer)["param"] == "conversation"
    for value in (7, {"id": ""}, {"name": "x"}):
        answer = client.post(
            "/v1/responses", json={"model": DEMO_MODEL, "input": "b", "conversation": value}
        )
        assert answer.status_code == 400 and assert_openai_error(answer)["param"] == "conversation"
    with pytest.raises(openai.NotFoundError) as missing:
        api.responses.create(model=DEMO_MODEL, input="x", conversation="conv_nope")
    assert missing.value.body["param"] == "conversation"


def test_a_background_turn_is_appended_when_it_ends(api):
    conversation = api.conversations.create(items=[_user("before")])
    queued = api.responses.create(
        model=DEMO_MODEL, input="later words", conversation=conversation.id, background=True
    )
    assert queued.status == "queued" and queued.conversation.id == conversation.id
    deadline = time.monotonic() + HANG_GUARD
    while api.responses.retrieve(queued.id).status != "completed":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    items = api.conversations.items.list(conversation.id, order="asc").data
    assert _texts(items) == ["before", "later words", "later words"]


def test_the_agents_sdk_keeps_its_session_in_a_conversation(gateway):
    set_tracing_disabled(True)  # the SDK would export its traces to OpenAI's servers

    async def run() -> tuple[list[Any], list[Any], Any, int]:
        async with async_openai_sdk(gateway.url) as client:
            agent = Agent(name="echo", model=OpenAIResponsesModel(DEMO_MODEL, client))
            session = OpenAIConversationsSession(openai_client=client)
            first = await Runner.run(agent, "hello session", session=session)
            second = await Runner.run(agent, "again please", session=session)
            items = await session.get_items()
            popped = await session.pop_item()
            left = len(await session.get_items())
            # the server keeps the conversation itself: a run that names it
            conversation = await client.conversations.create()
            await Runner.run(agent, "served side", conversation_id=conversation.id)
            served = [i async for i in client.conversations.items.list(conversation.id)]
            await session.clear_session()
            return [first.final_output, second.final_output], items, (popped, served), left

    outputs, items, (popped, served), left = asyncio.run(asyncio.wait_for(run(), HANG_GUARD))
    assert outputs == ["hello session", "again please"]
    roles = [item["role"] for item in items]
    assert roles == ["user", "assistant", "user", "assistant"]
    assert popped["role"] == "assistant" and left == 3
    assert [item.role for item in served] == ["assistant", "user"]


# -- teams and bounds ---------------------------------------------------------------------


def test_another_teams_conversation_is_not_found(gateway_with):
    search, ads = new_key("search"), new_key("ads")
    gw = gateway_with(**keyed({"search": {}, "ads": {}}, {search: "search", ads: "ads"}))
    with openai_sdk(gw.url, search) as mine, openai_sdk(gw.url, ads) as theirs:
        conversation = mine.conversations.create(items=[_user("secret")])
        item_id = mine.conversations.items.list(conversation.id).data[0].id
        for call in (
            lambda: theirs.conversations.retrieve(conversation.id),
            lambda: theirs.conversations.update(conversation.id, metadata={"k": "v"}),
            lambda: theirs.conversations.items.list(conversation.id),
            lambda: theirs.conversations.items.create(conversation.id, items=[_user("x")]),
            lambda: theirs.conversations.items.retrieve(item_id, conversation_id=conversation.id),
            lambda: theirs.conversations.items.delete(item_id, conversation_id=conversation.id),
            lambda: theirs.conversations.delete(conversation.id),
            lambda: theirs.responses.create(
                model=DEMO_MODEL, input="x", conversation=conversation.id
            ),
        ):
            with pytest.raises(openai.NotFoundError):
                call()
        assert _texts(mine.conversations.items.list(conversation.id).data) == ["secret"]


def test_items_and_conversations_are_bounded(gateway_with):
    gw = gateway_with(conversations_max_items=3, conversations_per_team=2)
    with openai_sdk(gw.url) as api:
        with pytest.raises(openai.BadRequestError) as refused:
            api.conversations.create(items=[_user("x")] * 4)
        assert refused.value.body["param"] == "items"
        full = api.conversations.create(items=[_user("a"), _user("b")])
        with pytest.raises(openai.BadRequestError) as refused:
            api.conversations.items.create(full.id, items=[_user("c"), _user("d")])
        assert refused.value.body["param"] == "items"
        with pytest.raises(openai.BadRequestError) as refused:
            api.responses.create(
                model=DEMO_MODEL, input=[_user("c"), _user("d")], conversation=full.id
            )
        assert refused.value.body["param"] == "conversation"
        # an input that fits is answered, and its answer kept whole past the bound
        api.responses.create(model=DEMO_MODEL, input="c", conversation=full.id)
        assert len(api.conversations.items.list(full.id).data) == 4
        with pytest.raises(openai.BadRequestError):
            api.conversations.items.create(full.id, items=[_user("e")])
        # the least recently changed conversation is dropped past the team's bound
        second = api.conversations.create()
        api.conversations.update(full.id, metadata={"k": "v"})
        api.conversations.create()
        with pytest.raises(openai.NotFoundError):
            api.conversations.retrieve(second.id)
        assert api.conversations.retrieve(full.id).metadata == {"k": "v"}


def _appended_at_once(url: str) -> tuple[str, list[str]]:
    """Twenty pairs of items added at once; the conversation's texts."""

    async def run() -> tuple[str, list[str]]:
        async with async_openai_sdk(url) as client:
            conversation = await client.conversations.create()
            await asyncio.gather(
                *(
                    client.conversations.items.create(
                        conversation.id, items=[_user(f"{n}a"), _user(f"{n}b")]
                    )
                    for n in range(20)
                )
            )
            items = [i async for i in client.conversations.items.list(conversation.id, order="asc")]
            return conversation.id, _texts(items)

    return asyncio.run(asyncio.wait_for(run(), HANG_GUARD))


def _assert_pairs_whole(texts: list[str]) -> None:
    assert len(texts) == 40
    assert sorted(texts[0::2]) == sorted(f"{n}a" for n in range(20))
    assert all(b == a[:-1] + "b" for a, b in zip(texts[0::2], texts[1::2], strict=True))


def test_appends_at_once_are_each_kept_whole(gateway):
    _assert_pairs_whole(_appended_at_once(gateway.url)[1])


# -- Redis ------------------------------------------------------------------------------


def test_two_replicas_share_conversations_in_redis(gateway_with, redis_server):
    one = gateway_with(redis_url=redis_server.url, redis_timeout=2.0)
    two = gateway_with(redis_url=redis_server.url, redis_timeout=2.0)
    with openai_sdk(one.url) as first, openai_sdk(two.url) as second:
        conversation = first.conversations.create(items=[_user("alpha")], metadata={"a": "1"})
        assert second.conversations.retrieve(conversation.id).metadata == {"a": "1"}
        with second.responses.stream(
            model=DEMO_MODEL, input="beta gamma", conversation=conversation.id
        ) as stream:
            answer = stream.get_final_response()
        assert answer.usage.input_tokens == 3
        turn = first.responses.create(
            model=DEMO_MODEL, input="delta", conversation=conversation.id, store=False
        )
        assert turn.usage.input_tokens == 1 + 2 + 2 + 1
        assert _texts(first.conversations.items.list(conversation.id, order="asc").data) == [
            "alpha",
            "beta gamma",
            "beta gamma",
            "delta",
            "delta",
        ]
        item_id = second.conversations.items.list(conversation.id, limit=1).data[0].id
        second.conversations.items.delete(item_id, conversation_id=conversation.id)
        assert len(first.conversations.items.list(conversation.id).data) == 4
        first.conversations.update(conversation.id, metadata={"b": "2"})
        assert second.conversations.retrieve(conversation.id).metadata == {"b": "2"}
        second.conversations.delete(conversation.id)
        with pytest.raises(openai.NotFoundError):
            first.conversations.items.list(conversation.id)
    _assert_pairs_whole(_appended_at_once(one.url)[1])


def test_redis_bounds_conversations_and_a_lost_redis_is_a_503(gateway_with, redis_server):
    gw = gateway_with(
        redis_url=redis_server.url,
        redis_timeout=0.2,
        conversations_max_items=3,
        conversations_per_team=2,
    )
    with openai_sdk(gw.url) as api, httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
        full = api.conversations.create(items=[_user("a"), _user("b"), _user("c")])
        with pytest.raises(openai.BadRequestError) as refused:
            api.conversations.items.create(full.id, items=[_user("d")])
        assert refused.value.body["param"] == "items"
        dropped = api.conversations.create()
        api.conversations.create()
        api.conversations.create()
        with pytest.raises(openai.NotFoundError):
            api.conversations.retrieve(full.id)
        with pytest.raises(openai.NotFoundError):
            api.conversations.items.list(full.id)
        redis_server.stop()
        for answer in (
            http.get(f"/v1/conversations/{dropped.id}"),
            http.post("/v1/conversations", json={}),
            http.post(
                "/v1/responses",
                json={"model": DEMO_MODEL, "input": "x", "conversation": dropped.id},
            ),
        ):
            assert answer.status_code == 503, answer.text
            assert assert_openai_error(answer)["type"] == "server_error"


def test_the_memory_store_bounds_a_teams_bytes(monkeypatch):
    """Conversations in memory count their object's and items' bytes: past the team's
    budget the least recently changed go, an append counting too."""
    monkeypatch.setattr(store_module, "MEMORY_BYTES_PER_TEAM", 800)
    memory = MemoryConversations(ttl=60, per_team=100, max_items=100)
    item = {"type": "message", "id": "msg_1", "role": "user", "content": [], "x": "y" * 100}

    async def run() -> list[bool]:
        for n in range(3):
            conversation = {"id": f"conv_{n}", "object": "conversation", "metadata": {}}
            await memory.create("search", conversation, [item])
        await memory.create("ads", {"id": "conv_9", "metadata": {}}, [item] * 3)  # its own
        kept = [await memory.get("search", f"conv_{n}") is not None for n in range(3)]
        await memory.append("search", "conv_1", [{**item, "id": f"msg_{n}"} for n in range(3)], 9)
        return [*kept, *[await memory.items("search", f"conv_{n}") is not None for n in (1, 2)]]

    assert asyncio.run(run()) == [True, True, True, True, False]
