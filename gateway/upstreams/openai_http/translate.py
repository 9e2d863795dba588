"""Their JSON, both ways, for `openai_http`: our `GenerateRequest` as the upstream's
body (`request_body`), their error bodies and error events as our errors (one table,
`HTTP_ERRORS` and `ERROR_CODES`), their logprobs as ours, and their pooling answers
(embeddings, rerank, classify) as ours. Pure functions of bytes and dicts (`read_capped`
aside), shared by both ways of calling them (httpx and the raw connections).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import zip_longest
from typing import Any, TypeVar

import httpx
import orjson

from gateway.protocol import errors
from gateway.protocol.chat import message_dict, tool_dict
from gateway.protocol.kv_transfer import PREFILL_TRANSFER, kv_transfer_text
from gateway.protocol.types import (
    TOKEN_ID_MAX,
    Classification,
    Classifications,
    Embeddings,
    EmbedRequest,
    GenerateRequest,
    ReasoningParams,
    RerankRequest,
    ResponseFormat,
    Scores,
    TokenLogprob,
    Tokens,
)

T = TypeVar("T")

#: Their HTTP status → our error; 400s are refined by the error body's code.
HTTP_ERRORS: dict[int, type[errors.GatewayError]] = {
    400: errors.Invalid,
    401: errors.AuthFailed,
    403: errors.AuthFailed,
    404: errors.ModelNotFound,
    408: errors.Timeout,
    413: errors.Invalid,
    422: errors.Invalid,
    429: errors.Busy,
    502: errors.Unavailable,
    503: errors.Unavailable,
    504: errors.Timeout,
}
#: Codes in their error bodies that name one of our errors.
ERROR_CODES: dict[str, type[errors.GatewayError]] = {
    "context_length_exceeded": errors.TooLong,
    "model_not_found": errors.ModelNotFound,
    "server_busy": errors.Busy,
    "engine_unavailable": errors.Unavailable,
    "timeout": errors.Timeout,
    "engine_auth_failed": errors.AuthFailed,
}
#: Servers that give no such code (vLLM answers `"code": 400`): what their message or
#: `param` says. vLLM: "This model's maximum context length is 1024 tokens. However,
#: your prompt contains at least 1025 input tokens ...", `"param": "input_tokens"`.
TOO_LONG_MESSAGES = ("maximum context length",)
TOO_LONG_PARAMS = ("input_tokens",)
#: The largest error body read from an upstream: past it the upstream is failing, and
#: reading on would only grow the gateway's memory.
MAX_ERROR_BYTES = 64 * 1024
#: The largest /models answer read from an upstream (a model entry is ~200 bytes): a
#: 200 MiB one, read whole, took the gateway to 1.36 GB at start.
MAX_MODELS_BYTES = 1024 * 1024
#: An embeddings answer may take this much per input (~10k floats as JSON text), plus
#: the error bound for the rest.
MAX_EMBEDDING_BYTES = 256 * 1024
#: A rerank answer may take this much per document besides the document itself, which
#: vLLM's answer repeats (at most 6 bytes a character, JSON-escaped).
MAX_RESULT_BYTES = 1024


def _error_fields(payload: Any) -> dict[str, Any]:
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        return error
    if isinstance(payload, dict) and payload.get("object") == "error":  # vLLM's older shape
        return payload
    return {}


async def read_capped(response: httpx.Response, limit: int) -> bytes:
    """At most `limit` bytes of a streamed response's body."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        chunks.append(chunk)
        size += len(chunk)
        if size >= limit:
            break
    return b"".join(chunks)[:limit]


def error_from_response(status: int, body: bytes) -> errors.GatewayError:
    """Our error for an upstream's error response."""
    try:
        fields = _error_fields(orjson.loads(body))
    except orjson.JSONDecodeError:
        fields = {}
    return _error(status, fields, f"upstream answered HTTP {status}")


def error_from_event(payload: dict[str, Any]) -> errors.GatewayError:
    """Our error for an error event in their stream. vLLM refuses some parameters
    only once streaming (e.g. an out-of-vocabulary `logit_bias` id): its event
    then has the HTTP status as its `code` and names the `param`, and reads as
    that response would."""
    fields = _error_fields(payload)
    code = fields.get("code")
    status = code if type(code) is int and code in HTTP_ERRORS else None
    return _error(status, fields, "upstream stream failed")


def _error(status: int | None, fields: dict[str, Any], default: str) -> errors.GatewayError:
    """The one table: their error body's code, else its status (`HTTP_ERRORS`),
    with vLLM's wording of a prompt beyond the context; no status: a failure."""
    message = str(fields.get("message") or default)
    error_type = ERROR_CODES.get(str(fields.get("code")))
    param = fields.get("param")
    if error_type is None and status == 400 and _too_long(message, param):
        return errors.TooLong(message)
    if error_type is None:
        if status is None:
            error_type = errors.Failed
        else:
            error_type = HTTP_ERRORS.get(status, errors.Failed if status >= 500 else errors.Invalid)
    return error_type(message, param=param if isinstance(param, str) else None)


def _too_long(message: str, param: Any) -> bool:
    """Whether a 400 without our code is a prompt beyond the context, as vLLM words it."""
    return param in TOO_LONG_PARAMS or any(m in message for m in TOO_LONG_MESSAGES)


def request_body(request: GenerateRequest) -> dict[str, Any]:
    """Our request as an OpenAI body, streamed with usage: every field the way
    OpenAI and vLLM take it (vLLM's extra sampling fields by vLLM's names)."""
    s, messages = request.sampling, request.messages
    body: dict[str, Any] = {
        "model": request.model,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if messages is not None:
        body["messages"] = list(map(message_dict, messages))
        if request.continue_final_message:  # vLLM's: never with the generation prompt
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
        elif not request.add_generation_prompt:
            body["add_generation_prompt"] = False
    else:
        body["prompt"] = request.prompt or ""
    body.update(s.given())
    if s.logit_bias:
        body["logit_bias"] = {str(token): bias for token, bias in s.logit_bias}
    if s.stop_token_ids:
        body["stop_token_ids"] = list(s.stop_token_ids)
    if request.stop:
        body["stop"] = list(request.stop)
    if request.include_stop:
        body["include_stop_str_in_output"] = True
    if not request.skip_special_tokens:
        body["skip_special_tokens"] = False
    if request.truncate_prompt_tokens is not None:
        body["truncate_prompt_tokens"] = request.truncate_prompt_tokens
    if request.return_token_ids:
        body["return_token_ids"] = True
    if request.n != 1:
        body["n"] = request.n
    if request.logprobs is not None:
        if messages is not None:  # a chat
            body["logprobs"] = True
            body["top_logprobs"] = request.logprobs
        else:
            body["logprobs"] = request.logprobs
    if request.tools:
        body["tools"] = [tool_dict(t) for t in request.tools]
    if request.tool_choice:
        choice = request.tool_choice
        body["tool_choice"] = (
            choice
            if choice in _TOOL_CHOICES
            else {"type": "function", "function": {"name": choice}}
        )
    if request.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = request.parallel_tool_calls
    answer = request.response_format
    if answer is not None:
        if answer.type in _STRUCTURED or (answer.type == "json_schema" and not answer.name):
            body["structured_outputs"] = _structured_outputs(answer)
        else:
            body["response_format"] = _response_format(answer)
    if request.user:
        body["user"] = request.user
    if request.reasoning is not None:
        body.update(_reasoning(request.reasoning))
    if request.kv_transfer:
        body["kv_transfer_params"] = orjson.loads(request.kv_transfer)
    return body


def prefill_body(request: GenerateRequest) -> dict[str, Any]:
    """The request as a prefill worker takes it: one token, one choice, whole, its KV
    blocks kept for the decode worker. `min_tokens` goes (it would exceed the one token);
    the rest stays, so the prompt is the one the decode worker renders."""
    body = request_body(request)
    body.update(stream=False, max_tokens=1, kv_transfer_params=PREFILL_TRANSFER)
    for name in ("stream_options", "n", "min_tokens", "max_completion_tokens"):
        body.pop(name, None)
    return body


def kv_transfer_from(content: bytes) -> str:
    """A prefill's answer's `kv_transfer_params` (a JSON object's text), or `Failed`."""
    try:
        answer = orjson.loads(content)
    except orjson.JSONDecodeError:
        answer = None
    return kv_transfer_text(answer.get("kv_transfer_params") if isinstance(answer, dict) else None)


_TOOL_CHOICES = frozenset({"none", "auto", "required"})


def _reasoning(reasoning: ReasoningParams) -> dict[str, Any]:
    """vLLM's reasoning fields, those that ask something."""
    fields: dict[str, Any] = {}
    if reasoning.effort or reasoning.off:
        fields["reasoning_effort"] = reasoning.effort or "none"
    if not reasoning.include:
        fields["include_reasoning"] = False
    if reasoning.template_kwargs:
        fields["chat_template_kwargs"] = orjson.loads(reasoning.template_kwargs)
    if reasoning.budget is not None:
        fields["thinking_token_budget"] = reasoning.budget
    return fields


#: Our ResponseFormat's types that are vLLM's `structured_outputs` alone.
_STRUCTURED = ("regex", "choice", "grammar")


def _structured_outputs(format: ResponseFormat) -> dict[str, Any]:
    """vLLM's `structured_outputs`, as the client gave it (a JSON schema without a name
    came that way)."""
    if format.type == "json_schema":
        return {"json": orjson.loads(format.schema)}
    if format.type == "choice":
        return {"choice": list(format.choice)}
    return {format.type: format.regex if format.type == "regex" else format.grammar}


def _response_format(format: ResponseFormat) -> dict[str, Any]:
    if format.type != "json_schema":
        return {"type": format.type}
    schema: dict[str, Any] = {"name": format.name}
    if format.schema:
        schema["schema"] = orjson.loads(format.schema)
    if format.strict:
        schema["strict"] = True
    return {"type": "json_schema", "json_schema": schema}


def _chat_logprobs(logprobs: Any) -> tuple[TokenLogprob, ...] | None:
    """A chat choice's `logprobs.content`: one entry per token, alternatives in the
    server's order."""
    content = logprobs.get("content") if type(logprobs) is dict else None
    if not content:
        return None
    return tuple(
        TokenLogprob(
            entry["token"],
            entry["logprob"],
            tuple((alt["token"], alt["logprob"]) for alt in entry.get("top_logprobs") or ()),
        )
        for entry in content
    )


def _completion_logprobs(logprobs: Any) -> tuple[TokenLogprob, ...] | None:
    """A completion choice's logprobs: parallel lists of tokens, their logprobs and
    {token: logprob} alternatives."""
    tokens = logprobs.get("tokens") if type(logprobs) is dict else None
    if not tokens:
        return None
    tops = logprobs.get("top_logprobs") or ()
    return tuple(
        TokenLogprob(token, value, tuple((top or {}).items()))
        for token, value, top in zip_longest(tokens, logprobs.get("token_logprobs") or (), tops)
    )


def _pooling_error(status: int, body: bytes, serves: str = "embeddings") -> errors.GatewayError:
    """Our error for a refused embedding or rerank: a 404 that is not an OpenAI error
    (vLLM has no such route for a model of another task) says the model serves no
    `serves`."""
    if status == 404:
        try:
            fields = _error_fields(orjson.loads(body))
        except orjson.JSONDecodeError:
            fields = {}
        if not fields:
            return errors.Invalid(f"The model's upstream serves no {serves}.", param="model")
    return error_from_response(status, body)


#: The fields of our request that vLLM's `/tokenize` reads (its chat form and its text form).
_TOKENIZE_FIELDS = (
    "model",
    "messages",
    "prompt",
    "tools",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
)


def tokenize_body(request: GenerateRequest) -> dict[str, Any]:
    """vLLM's `/tokenize` body for the prompt `request` makes (a chat ended as a chat
    completion renders it: with its generation prompt unless it asks otherwise, which
    `/tokenize` does not default to)."""
    body = {k: v for k, v in request_body(request).items() if k in _TOKENIZE_FIELDS}
    if request.messages is not None:
        body.setdefault("add_generation_prompt", True)
    return body


def _tokenizer_answer(status: int, content: bytes, route: str) -> dict[str, Any]:
    """vLLM's answer at `route` (`/tokenize`, `/detokenize`) as a dict; a server without
    the route (404 or 405), or one refusing it naming `model`, cannot (`CannotCount`: a
    400 naming `model`)."""
    if status in (404, 405):
        raise errors.CannotCount(
            f"The model's upstream server has no {route}: it cannot count or show tokens.",
            param="model",
        )
    if status != 200:
        raise errors.CannotCount.of(error_from_response(status, content))
    payload = _json(content, route)
    if type(payload) is not dict:
        raise errors.Failed(f"The upstream's {route} answer is not an object.")
    return payload


def tokens_counted(status: int, content: bytes) -> int:
    """The count of vLLM's `/tokenize` answer (`_tokenizer_answer`'s refusals)."""
    count = _tokenizer_answer(status, content, "/tokenize").get("count")
    if type(count) is not int or count < 0:
        raise errors.Failed("The upstream's /tokenize answer has no count.")
    return count


def tokens_from(status: int, content: bytes, token_strs: bool) -> Tokens:
    """The ids (and with `token_strs`, their strings) of vLLM's `/tokenize` answer."""
    payload = _tokenizer_answer(status, content, "/tokenize")
    ids = payload.get("tokens")
    if type(ids) is not list or not all(type(i) is int and 0 <= i <= TOKEN_ID_MAX for i in ids):
        raise errors.Failed("The upstream's /tokenize answer has no list of token ids.")
    if not token_strs:
        return Tokens(ids)
    strs = payload.get("token_strs")
    if type(strs) is not list or len(strs) != len(ids) or not all(type(t) is str for t in strs):
        raise errors.Failed("The upstream's /tokenize answer has no string for each token.")
    return Tokens(ids, strs)


def text_detokenized(status: int, content: bytes) -> str:
    """The text of vLLM's `/detokenize` answer (`_tokenizer_answer`'s refusals)."""
    text = _tokenizer_answer(status, content, "/detokenize").get("prompt")
    if type(text) is not str:
        raise errors.Failed("The upstream's /detokenize answer has no text.")
    return text


def _json(content: bytes, what: str) -> Any:
    """An upstream's answer parsed, or `Failed` naming `what` it is."""
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        raise errors.Failed(f"The upstream's {what} answer is not JSON.") from None


def _placed(
    payload: Any,
    field: str | None,
    count: int,
    what: str,
    read: Callable[[dict[str, Any]], T | None],
    positional: bool = False,
) -> tuple[list[T], int]:
    """A pooling answer's `count` items (its `field`, or the payload itself where None: a
    list of objects, each `read` into a value, None when it is not one), placed by their
    `index` (with `positional`, an item without one is at its place), and the prompt's
    tokens its `usage` gives (`total_tokens` where it has no `prompt_tokens`; 0 where
    neither). Anything else is `Failed`, naming `what` an item is."""
    items = payload if field is None else payload.get(field) if type(payload) is dict else None
    if type(items) is not list or len(items) != count:
        got = len(items) if type(items) is list else "no"
        raise errors.Failed(f"The upstream gave {got} {what} items for {count}.")
    placed: list[T | None] = [None] * count
    for position, item in enumerate(items):
        fields = item if type(item) is dict else {}
        index = fields.get("index", position if positional else None)
        value = read(fields) if fields else None
        if (
            not isinstance(index, int)
            or isinstance(index, bool)
            or not 0 <= index < count
            or placed[index] is not None
            or value is None
        ):
            raise errors.Failed(f"The upstream's {what} {position} is not one.")
        placed[index] = value
    usage = payload.get("usage") if type(payload) is dict else None
    tokens = usage.get("prompt_tokens", usage.get("total_tokens")) if type(usage) is dict else None
    return [v for v in placed if v is not None], tokens if type(tokens) is int else 0


def _numbers(value: Any) -> tuple[float, ...] | None:
    """A list of numbers (not booleans) as floats, or None."""
    if type(value) is not list or not all(type(x) is float or type(x) is int for x in value):
        return None
    return tuple(map(float, value))


def embeddings_from(content: bytes, request: EmbedRequest) -> Embeddings:
    """Their embeddings answer: one vector of numbers per input, all of one width
    (`dimensions` when asked), placed by their `index`."""
    vectors, tokens = _placed(
        _json(content, "embeddings"),
        "data",
        request.count,
        "embedding",
        lambda item: _numbers(item.get("embedding")),
        positional=True,
    )
    widths = {len(v) for v in vectors}
    if len(widths) != 1 or (request.dimensions is not None and widths != {request.dimensions}):
        raise errors.Failed(f"The upstream's embeddings have widths {sorted(widths)}.")
    return Embeddings(tuple(vectors), tokens)


def rerank_limit(request: RerankRequest) -> int:
    """The most bytes of a rerank answer read for `request`."""
    documents = request.documents
    return MAX_ERROR_BYTES + MAX_RESULT_BYTES * len(documents) + 6 * sum(map(len, documents))


def _score(item: dict[str, Any]) -> float | None:
    score = item.get("relevance_score", item.get("score"))
    return float(score) if type(score) is float or type(score) is int else None


def scores_from(content: bytes, request: RerankRequest) -> Scores:
    """Their rerank answer, a score for each document placed by its `index`, in any
    order: vLLM's, Jina's and Cohere's shape (`results` of `index` and `relevance_score`,
    and `usage`), or SGLang's (a list of `index` and `score`, each with its own
    `meta_info.prompt_tokens`)."""
    count, payload = len(request.documents), _json(content, "rerank")
    if type(payload) is not list:
        scores, tokens = _placed(payload, "results", count, "rerank result", _score)
        return Scores(tuple(scores), tokens)
    scores, _ = _placed(payload, None, count, "rerank result", _score)
    metas = (item.get("meta_info") for item in payload)
    counts = (meta.get("prompt_tokens") if type(meta) is dict else None for meta in metas)
    return Scores(tuple(scores), sum(n for n in counts if type(n) is int))


def _classification(item: dict[str, Any]) -> Classification | None:
    label, probs = item.get("label"), _numbers(item.get("probs"))
    if not (label is None or type(label) is str) or not probs:
        return None
    return Classification(label, probs)


def classifications_from(content: bytes, request: EmbedRequest) -> Classifications:
    """Their `/classify` answer (vLLM's): one `label` (or null) and `probs` per input,
    placed by their `index`."""
    count = request.count
    payload = _json(content, "classify")
    items, tokens = _placed(payload, "data", count, "classification", _classification)
    return Classifications(tuple(items), tokens)
