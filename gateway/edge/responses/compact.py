"""`POST /v1/responses/compact` (the SDK's `responses.compact`): a conversation
compacted, for a client that keeps its own (the OpenAI Agents SDK's compaction session):
the answer, `{"object": "response.compaction", "output": [...], "usage": ...}`, holds the
conversation's user messages as they came, then one `compaction` item whose
`encrypted_content` is the model's summary of the whole conversation. Sent back as
input (with the turns after it), that item is the summary's user message
(gateway/edge/compacting.py) where it stands in the conversation (params.py).

The body is read as `POST /v1/responses` reads it (its route's `parse_body`: input
items, `instructions`, `previous_response_id`'s stored conversation, `prompt_cache_key`,
with their bounds); only the fields OpenAI defines for this route are taken, any other is
a 400 naming it, and `image`'s and `prompt_cache_options`' options, which ask what these
models do not have, are refused by name. The summary is a generation of the model's
(the generation route: admission, a slot, the deadline, the ledger, the metrics), its
prompt the conversation's with the summarizing prompt after it; its reasoning, if any, is
left out. `encrypted_content` is opaque, not encrypted: the compressed summary in
base64url (params.py: `opaque`), as this gateway's reasoning items are. Nothing is
stored.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import orjson

from gateway.edge.compacting import summarizing
from gateway.edge.errors import invalid, unknown_parameters
from gateway.edge.openai.encoding import Encoder
from gateway.edge.openai.generation import GenerationRoute
from gateway.edge.responses.conversation_store import kept_item
from gateway.edge.responses.encoding import usage
from gateway.edge.responses.params import COMPACTION, Item, new_id, opaque
from gateway.edge.responses.routes import (
    CHAT_PARAMS,
    RESPONSES,
    ResponsesRequest,
    ResponsesRoute,
)
from gateway.protocol.types import Event, Reasoning, Text

if TYPE_CHECKING:
    from gateway.edge.openai.input_limits import InputLimits
    from gateway.edge.openai.validation import ParsedRequest
    from gateway.edge.request import Exchange, Parts
    from gateway.fleet.pool import ModelPool

COMPACT = RESPONSES + "/compact"
#: The body's fields OpenAI defines for this route.
FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "previous_response_id",
        "prompt_cache_key",
        "prompt_cache_retention",
        "service_tier",
        "image",
        "prompt_cache_options",
    }
)
#: Of those, the ones that ask what these models do not have, refused at any value but null.
UNSERVED = ("image", "prompt_cache_options")


def check_fields(body: Any) -> None:
    """A 400 naming the first field this route does not take, or takes but does not serve."""
    if not isinstance(body, dict):
        raise invalid(None, "The body must be a JSON object.")
    unknown_parameters(body, FIELDS)
    for name in UNSERVED:
        if body.get(name) is not None:
            raise invalid(name, f"'{name}' is not supported by this gateway.")


class CompactRoute(GenerationRoute):
    """`POST /v1/responses/compact`, reading bodies as `responses` does."""

    def __init__(self, parts: Parts, limits: InputLimits, responses: ResponsesRoute) -> None:
        super().__init__(responses.parse, CompactEncoder, parts, limits, CHAT_PARAMS)
        self.responses = responses

    async def parse_body(self, body: Any, ex: Exchange) -> ParsedRequest:
        check_fields(body)
        parsed = await self.responses.parse_body(body, ex)
        assert isinstance(parsed, ResponsesRequest) and parsed.body is not None
        return replace(parsed, generate=summarizing(parsed.generate), stream=False)

    def encoder(self, parsed: ParsedRequest, pool: ModelPool) -> Encoder:
        assert isinstance(parsed, ResponsesRequest) and parsed.body is not None
        return CompactEncoder(pool.name, [*parsed.history, *parsed.body.items])


class CompactEncoder(Encoder):
    """The compaction object of one summary (a whole answer: the route never streams)."""

    def __init__(self, model: str, items: Sequence[Item]) -> None:  # no templates of chat's
        self.id = new_id("resp")
        self.model = model
        self.plain = False
        self.created_at = int(time.time())
        self._kept = [
            kept_item(item)
            for item in items
            if item["type"] == "message" and item["role"] == "user"
        ]
        self._texts: list[str] = []
        self.reasoning_tokens = 0

    def add(self, batch: list[Event]) -> None:
        """Gathers the summary's text (its reasoning counted, left out)."""
        for event in batch:
            if type(event) is Text:
                self._texts.append(event.text)
            elif type(event) is Reasoning:
                self.reasoning_tokens += event.tokens

    def answer(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> bytes:
        """The `response.compaction` object."""
        summary = "".join(self._texts).strip()
        item = {"id": new_id("cmp"), "type": COMPACTION, "encrypted_content": opaque(summary)}
        counted = usage(prompt_tokens, completion_tokens, self.reasoning_tokens, cached_tokens)
        compacted: dict[str, Any] = {
            "id": self.id,
            "object": "response.compaction",
            "created_at": self.created_at,
            "output": [*self._kept, item],
            "usage": counted,
        }
        return orjson.dumps(compacted)
