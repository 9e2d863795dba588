"""The edge: every HTTP route and what they share.

    app.py         the Starlette app: routes, middleware, OpenAI-shaped errors
    asgi.py        raw-ASGI types and whole-JSON responses
    errors.py      APIError and the one table from the error tree to HTTP
    middleware.py  header size (431), API keys (401), x-ratelimit-* headers
    ops.py         /health, /ready, /metrics, /metrics/json, /admin/workers
    openai/        the OpenAI API: bodies, validation, encoders, the routes

The edge knows nothing of gRPC or protobuf.
"""
