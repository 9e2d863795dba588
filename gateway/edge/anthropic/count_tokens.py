"""`POST /v1/messages/count_tokens`: the tokens the prompt of a Messages body
would take (system, messages, tools), `{"input_tokens": N}`.

Counted where the model's chat template and tokenizer are: by the gateway's own
tokenizer for a `vllm-grpc` model, else by a worker (our workers' `CountTokens`
RPC, an OpenAI-compatible server's `/tokenize`), through the fleet's unary call
(`gateway.fleet.counting`). The request is admitted like any other (drain, team
limits, a slot), bounded by `request_timeout`, cancelled when its client leaves,
and leaves one record in the metrics and the access log. It uses no tokens: a
count is not a prompt the engine took, so the ledger, the budgets, the team's
token limits and the token counters see none (Anthropic does not bill counting
either); the count is on the request's span.
"""

from __future__ import annotations

from dataclasses import replace

import orjson

from gateway.edge.anthropic.validation import parse_count
from gateway.edge.asgi import send_json
from gateway.edge.openai.body import read_json
from gateway.edge.openai.validation import model_of
from gateway.edge.request import Exchange, RequestRoute, priority
from gateway.fleet.counting import count_tokens
from gateway.protocol.deadline import Deadline
from gateway.protocol.errors import Outcome
from gateway.telemetry.tracing import annotate

#: The CLIENT span's name for a worker call: the gRPC method it is.
COUNT_TOKENS = "furnace.engine/CountTokens"


class CountTokensRoute(RequestRoute[Exchange]):
    """`POST /v1/messages/count_tokens` in the edge's request frame (request.py)."""

    exchange = Exchange

    async def serve(self, ex: Exchange) -> None:
        """Reads and checks the body, admits it through admission's stages, has the
        prompt counted and answers."""
        ctx, record = ex.ctx, ex.record
        admission = self.admission
        meter = admission.before_body(ctx)  # the team's rate, and the bytes being read
        body = await read_json(ex.scope, ex.receive, self.config.max_body_bytes, meter)
        pool = admission.visibility(ctx, model_of(body))
        request = replace(parse_count(body, record.request_id), model=pool.name)
        ctx.request = request
        ctx.priority = priority(ex)
        ex.watch_client()  # from here: a client that leaves while queued leaves the queue
        timeout = self.config.request_timeout
        async with admission.admit(ctx):
            with self.tracing.engine_call(pool.name, ex.metadata, COUNT_TOKENS) as (span, meta):
                work = count_tokens(self.fleet, pool, request, Deadline(timeout), meta)
                tokens, record.worker = await admission.unary(ctx, work, timeout, "The count")
                annotate(span, {"furnace.worker": record.worker, "furnace.counted_tokens": tokens})
        record.status, record.outcome = 200, Outcome.COMPLETED
        request_id = record.request_id.encode("latin-1")
        answer = orjson.dumps({"input_tokens": tokens})
        await send_json(ex.send, 200, answer, [(b"x-request-id", request_id)])
