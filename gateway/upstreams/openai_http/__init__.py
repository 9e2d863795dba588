"""OpenAI-compatible HTTP servers as workers: vLLM, SGLang, TGI's OpenAI API, or
another furnace-gateway, behind the same fleet as gRPC workers.

Our request becomes their `/chat/completions` or `/completions` call with
`stream: true` and usage included; their server-sent events become our events;
their errors map into our error tree (`HTTP_ERRORS`), so the edge answers them
as it answers a gRPC worker's. Upstreams share one pooled `httpx.AsyncClient`
(one per private CA, `ca_file`), and plain http:// ones stream over their own
connections (`connections`); a model's `api_key_env` key goes as
`Authorization: Bearer` on each of its calls, and only there (never in a log or
an error). A client that leaves closes the upstream stream.

Every field of our request goes into their body as OpenAI and vLLM name it
(`request_body`: messages and tools in `gateway.protocol.chat`'s shapes,
tool_choice, response_format, logprobs, n, user, and vLLM's extra sampling
fields); `describe` says they serve every feature, so what a server cannot do
it refuses itself, and its 400 naming the parameter reaches the client as
one. Their chunks become our events choice by choice: content (with logprobs)
as `Text`, `delta.tool_calls` as `ToolCallDelta`, each choice's finish reason
as its `Finished`; `embed` is their `/embeddings`.

Their stream has no `Started` with the prompt's size: `Started(0)` goes out
with their first event, so an error event in its place is still a refusal; at most
`HEAD_GRACE` (5 ms) after their head said 200 (over our own connections or httpx),
so that the edge's head reaches the client while the engine prefills, as
vLLM's own server sends it (the client's work on a head then overlaps the prefill:
about 1 ms of added TTFT on a 2-core VM, `benchmarks/bench_vllm.py --relay`). The
prompt tokens ride on `Finished` from their usage chunk (with its
`prompt_tokens_details.cached_tokens`, which vLLM sends with `--enable-prompt-tokens-details`).
A request of vLLM's `return_token_ids` is sent on; its `Started` waits for their first event
(its chunk says the prompt's ids), and each chunk's `token_ids` ride on the events it made
(`sse.IdsStream`, which parses every line whole: the plain requests keep the fast path).

One job a module:

    translate.py    our request → their JSON body; their error bodies and events,
                    logprobs and embeddings answers → ours
    sse.py          their event stream (SSE bytes) → our events (`_Stream`)
    audio.py        speech to text: our request → their form; their transcript,
                    whole or streamed (vLLM's chunks or OpenAI's events) → ours
    connections.py  plain http:// streams over our own kept-alive connections
                    (`gateway.protocol.http1`): `_RawCall`
    upstream.py     `OpenAIHttpUpstream` (the worker) and `OpenAIHttpCall` (a
                    stream over the fleet's httpx client: https, proxies)
    loads.py        their Prometheus `/metrics` → the engine's load record (vLLM's
                    running, waiting, KV-cache use), for routing
    polls.py        the polls the engines of one data-parallel server share: one
                    GET a server, not one an engine
    client.py       the fleet's httpx client, whose connections close when a call
                    is cancelled in their TLS handshake (httpcore's do not)

A plain http:// upstream's /health and /metrics polls go over the same connections
(`http1.fetch`); https, a proxy from the environment, embeddings and /models go through
the fleet's httpx client (TLS and its CA, proxies).
"""

from gateway.upstreams.openai_http.client import http_client
from gateway.upstreams.openai_http.sse import MAX_EVENT_BYTES
from gateway.upstreams.openai_http.translate import (
    ERROR_CODES,
    HTTP_ERRORS,
    MAX_EMBEDDING_BYTES,
    MAX_ERROR_BYTES,
    TOO_LONG_MESSAGES,
    TOO_LONG_PARAMS,
    embeddings_from,
    error_from_event,
    error_from_response,
    read_capped,
    request_body,
)
from gateway.upstreams.openai_http.upstream import OpenAIHttpCall, OpenAIHttpUpstream

__all__ = [
    "ERROR_CODES",
    "HTTP_ERRORS",
    "MAX_EMBEDDING_BYTES",
    "MAX_ERROR_BYTES",
    "MAX_EVENT_BYTES",
    "TOO_LONG_MESSAGES",
    "TOO_LONG_PARAMS",
    "OpenAIHttpCall",
    "OpenAIHttpUpstream",
    "embeddings_from",
    "error_from_event",
    "error_from_response",
    "http_client",
    "read_capped",
    "request_body",
]
