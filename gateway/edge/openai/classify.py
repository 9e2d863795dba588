"""`POST /classify` (and `/v1/classify`), as vLLM's server answers it for a classification
model (a `*ForSequenceClassification`, served with `--runner pooling`: a sentiment,
intent or safety classifier): the label and the probability of each class, an entry an
input, classified by the model's workers, over the embeddings' route (embeddings.py: its
admission, fallbacks, bounds, telemetry and usage ledger).

Input: `input` as on embeddings (a string, a list of strings, token ids or lists of token
ids; at most 2,048, none empty), or vLLM's chat form: `messages`, one conversation its
server renders with the model's chat template and classifies as one input (with
`add_generation_prompt`, `continue_final_message`, `add_special_tokens`,
`chat_template_kwargs`, as on embeddings). `user` goes to the workers. vLLM's options that
change what is computed (`use_activation`, truncation, `add_special_tokens: false` with
`input`, the multimodal ones) are refused by name unless at their defaults.

Served by `upstream: openai` models, whose workers' `/classify` (beside `/v1`) answers;
others are a 400 naming `model` (neither our worker protocol nor vLLM's gRPC server has a
classification call). A worker whose model classifies nothing (vLLM has no such route for
it) is a 400 naming `model` too.

Answer: `{"id": "classify-…", "object": "list", "created", "model", "data": [{"index",
"label", "probs", "num_classes"}], "usage": {"prompt_tokens", "total_tokens",
"completion_tokens": 0}}`.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.edge.errors import invalid
from gateway.edge.openai.embeddings import (
    EmbeddingsRoute,
    Pooled,
    _inputs,
    chat_form,
    chat_unserved,
    user_of,
)
from gateway.edge.openai.validation import _unserved, model_of
from gateway.fleet import ModelPool
from gateway.fleet.embedding import classify
from gateway.protocol.deadline import Deadline
from gateway.protocol.types import ChatForm, Classifications, EmbedRequest, Pooling

#: Where it is served: vLLM's own path, and beside the other /v1 routes.
CLASSIFY_PATHS = ("/classify", "/v1/classify")
#: vLLM's classification options not served, with the value that asks nothing of them.
UNSERVED_CLASSIFY: dict[str, Any] = {
    "use_activation": None,
    "truncate_prompt_tokens": None,
    "truncation_side": None,
    "add_special_tokens": True,
    "mm_processor_kwargs": None,
    "priority": 0,
    "request_id": None,
    "cache_salt": None,
    "dimensions": None,
}
UNSERVED_CLASSIFY_CHAT = chat_unserved(UNSERVED_CLASSIFY)


@dataclass(frozen=True, slots=True)
class ClassifyBody:
    """A valid classify body: what to classify."""

    inputs: tuple[str | tuple[int, ...], ...]
    user: str = ""
    dimensions: None = None
    #: The chat form's conversation and options (then no `inputs`); None: the text form.
    chat: ChatForm | None = None

    def answer(self, model: str, result: Pooling) -> bytes:
        """The response body, of the model that served."""
        assert isinstance(result, Classifications)  # what `ClassifyRoute.work` gives
        tokens = result.prompt_tokens
        return orjson.dumps(
            {
                "id": "classify-" + secrets.token_hex(12),
                "object": "list",
                "created": int(time.time()),
                "model": model,
                "data": [
                    {
                        "index": i,
                        "label": item.label,
                        "probs": item.probs,
                        "num_classes": len(item.probs),
                    }
                    for i, item in enumerate(result.items)
                ],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
            }
        )


def parse_classify(body: Any) -> ClassifyBody:
    """The body checked, or a 400 naming the parameter at fault."""
    model_of(body)
    chat = chat_form(body, embeddings=False)
    if chat is not None:
        _unserved(body, UNSERVED_CLASSIFY_CHAT)
        return ClassifyBody((), user_of(body), chat=chat)
    _unserved(body, UNSERVED_CLASSIFY)
    if "input" not in body:
        raise invalid("input", "Missing required parameter: 'input'.")
    return ClassifyBody(_inputs(body["input"]), user_of(body))


class ClassifyRoute(EmbeddingsRoute):
    """`POST /classify` on the embeddings' route, its workers' classifications."""

    span = "furnace.engine/Classify"
    what = "The classification"

    def parse(self, body: Any) -> Pooled:
        return parse_classify(body)

    def check(self, pool: ModelPool, request: EmbedRequest) -> None:
        if not pool.relays_answers:
            raise invalid(
                "model",
                f"The model `{pool.name}` does not serve classification (only models of "
                "OpenAI-compatible servers, `upstream: openai`, do).",
            )

    def work(
        self,
        pool: ModelPool,
        request: EmbedRequest,
        parsed: Pooled,
        deadline: Deadline,
        metadata: tuple[tuple[str, str], ...],
    ) -> Awaitable[tuple[Pooling, str]]:
        return classify(self.fleet, pool, request, deadline, metadata)
