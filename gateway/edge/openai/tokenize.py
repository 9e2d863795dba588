"""`POST /tokenize` and `POST /detokenize` (also under `/v1`), as vLLM's server answers
them: the token ids of the prompt a request makes, and the text ids decode to, by the
model's own tokenizer and chat template. So a client sees exactly what its chat or
completion would send the engine (its length against `max_model_len`, where a template
puts its tokens), and turns ids (a `logit_bias`, `stop_token_ids`, an answer's
`return_token_ids`) back into text.

`/tokenize` takes vLLM's two forms: a chat (`messages`, with `tools`,
`chat_template_kwargs`, `add_generation_prompt` and `continue_final_message`, rendered as a
chat completion is) or a text (`prompt`, one string, with the model's BOS where it adds
one, as a completion is); `return_token_strs` adds each token's string in the vocabulary.
The answer: `{"count", "max_model_len", "tokens", "token_strs"}`. What would tokenize
another prompt than a chat completion or a completion sends (`add_special_tokens` away from
those forms' defaults, a `chat_template` of the client's, the multimodal options) is
refused by name, as on those routes; any other field is an unknown parameter.

`/detokenize` takes `tokens` (at most `MAX_DETOKENIZE_IDS` ids) and answers
`{"prompt": text}`, special tokens kept; an id outside the vocabulary is a 400 naming
`tokens` (from our workers and the gateway's own tokenizer; an OpenAI-compatible server
answers for itself).

Answered where the model's tokenizer is (`gateway.fleet.counting`): the gateway's own
for a `vllm-grpc` model, else a worker (our workers' `Tokenize`/`Detokenize` RPCs when
their model lists "tokenize", an OpenAI-compatible server's own routes); a model whose
workers cannot is a 400 naming `model`. Admitted, bounded, timed and recorded as a
count is (gateway/edge/counting.py): no tokens billed.
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import replace
from typing import Any

from gateway.edge.counting import Metadata, TokenizerRoute, on_tokenizer
from gateway.edge.errors import invalid, unknown_parameters
from gateway.edge.openai.generation import check_relayed_media
from gateway.edge.openai.validation import _flag, parse_chat, parse_completion
from gateway.edge.request import Exchange
from gateway.fleet.counting import detokenize, tokenize
from gateway.fleet.pool import ModelPool
from gateway.protocol.deadline import Deadline
from gateway.protocol.types import TOKEN_ID_MAX, GenerateRequest, Tokens

#: Where each is served: vLLM's own paths, and beside the other /v1 routes.
TOKENIZE_PATHS = ("/tokenize", "/v1/tokenize")
DETOKENIZE_PATHS = ("/detokenize", "/v1/detokenize")
#: The most ids one `/detokenize` takes (a million: past any model's context).
MAX_DETOKENIZE_IDS = 1 << 20
#: The CLIENT spans' names for the worker calls: the gRPC methods they are.
TOKENIZE = "furnace.engine/Tokenize"
DETOKENIZE = "furnace.engine/Detokenize"

#: The fields of each form of `/tokenize` (vLLM's), those it refuses away from their
#: defaults included (the chat and completion parsers refuse them by name).
_OPTIONS = frozenset({"model", "add_special_tokens", "return_token_strs"})
_CHAT = _OPTIONS | {
    "messages",
    "tools",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "mm_processor_kwargs",
    "media_io_kwargs",
}
_TEXT = _OPTIONS | {"prompt"}

#: A `/tokenize` body as read: the request whose prompt it shows, and `return_token_strs`.
Tokenizing = tuple[GenerateRequest, bool]


class TokenizeRoute(TokenizerRoute[Tokenizing]):
    """`POST /tokenize`: the prompt's ids (and strings), its count and the model's context."""

    async def parse(self, body: Any, ex: Exchange) -> Tokenizing:
        chat = "messages" in body
        unknown_parameters(body, _CHAT if chat else _TEXT)
        strs = _flag(body, "return_token_strs")
        body.pop("return_token_strs", None)  # (not the generation parsers' to read)
        parse = parse_chat if chat else parse_completion
        return parse(body, ex.record.request_id).generate, strs

    def prompt(self, parsed: Tokenizing) -> GenerateRequest:
        return parsed[0]

    async def work(self, ex: Exchange, pool: ModelPool, parsed: Tokenizing) -> dict[str, Any]:
        request, strs = replace(parsed[0], model=pool.name), parsed[1]
        check_relayed_media(pool, request)  # an OpenAI-compatible server counts their tokens

        def work(deadline: Deadline, metadata: Metadata) -> Awaitable[tuple[Tokens, str]]:
            return tokenize(self.fleet, pool, request, strs, deadline, metadata)

        tokens = await on_tokenizer(self, ex, pool, TOKENIZE, "The tokenization", work, _count)
        return {
            "count": len(tokens.ids),
            "max_model_len": pool.max_context,
            "tokens": tokens.ids,
            "token_strs": tokens.strs,
        }


def _count(tokens: Tokens) -> int:
    return len(tokens.ids)


#: A `/detokenize` body as read: its ids.
Detokenizing = list[int]


class DetokenizeRoute(TokenizerRoute[Detokenizing]):
    """`POST /detokenize`: the text of token ids, special tokens kept."""

    async def parse(self, body: Any, ex: Exchange) -> Detokenizing:
        unknown_parameters(body, ("model", "tokens"))
        ids = body.get("tokens")
        if type(ids) is not list:
            raise invalid("tokens", "'tokens' is required: a list of token ids.")
        if len(ids) > MAX_DETOKENIZE_IDS:
            raise invalid("tokens", f"'tokens' holds at most {MAX_DETOKENIZE_IDS} ids.")
        if not all(type(i) is int and 0 <= i <= TOKEN_ID_MAX for i in ids):
            raise invalid("tokens", "Invalid value for 'tokens': expected token ids (integers).")
        return ids

    def prompt(self, parsed: Detokenizing) -> None:
        return None

    async def work(self, ex: Exchange, pool: ModelPool, parsed: Detokenizing) -> dict[str, Any]:
        def work(deadline: Deadline, metadata: Metadata) -> Awaitable[tuple[str, str]]:
            return detokenize(self.fleet, pool, parsed, deadline, metadata)

        text = await on_tokenizer(self, ex, pool, DETOKENIZE, "The detokenization", work)
        return {"prompt": text}
