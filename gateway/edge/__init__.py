"""The edge: every HTTP route and what they share.

    app.py         the Starlette app: routes, middleware, OpenAI-shaped errors
    admin_proxy.py the admin listener of several processes, from each one's own
    asgi.py        raw-ASGI types and whole-JSON responses
    errors.py      APIError and the one table from the error tree to HTTP
    http_protocol.py  uvicorn's parser with bounds: header size/count (431), header
                   and body deadlines (408), connections (503)
    middleware.py  API keys (401), x-ratelimit-* headers, JSON bodies (415), Host (421)
    forms.py       a multipart/form-data body read whole, bounded, cut into its parts
                   (the Files API's uploads, the audio routes)
    ops.py         /health, /ready, /metrics, /metrics/json, /admin/workers
    request.py     the frame of the routes that serve a request on the fleet: id and
                   metadata, refusals, telemetry, the span (generation, embeddings, infer)
    counting.py    the routes a model's tokenizer answers (Anthropic's count_tokens,
                   the Responses API's input_tokens, /tokenize) on that frame
    compacting.py  a conversation summarized by its model: the prompt, the message it
                   goes on from (Anthropic's compaction, /v1/responses/compact)
    openai/        the OpenAI API: bodies, validation, encoders, the routes
    responses/     OpenAI's Responses API on the same request path, and its store
    batches/       OpenAI's Batch API and its files: a team's JSONL of requests run
                   through the routes above, at a low priority, into an output file
    kserve/        the KServe v2 API for tensor models
    anthropic/       Anthropic's Messages API on the same request path
    mcp/             remote MCP servers a request lets the model call, and the turns
                     of an answer around the calls (the Responses API's `mcp` tools,
                     Anthropic's MCP connector)
    usage.py         GET /admin/usage: the usage ledger on the admin listener
    write_guard.py   a bound on how long one write may wait on a client that stops reading

The edge knows nothing of gRPC or protobuf.
"""
