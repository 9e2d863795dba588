"""Anthropic's Message Batches API (`/v1/messages/batches`), on the Batch API's store and
runs: `POST` (the requests inline, `{custom_id, params}` each), `GET` (a page, newest
first, `before_id`/`after_id`/`limit`), `GET /{id}`, `POST /{id}/cancel`, `DELETE /{id}`
(an ended batch only, as Anthropic's), and `GET /{id}/results`, the JSONL the SDK's
`results()` reads from the batch's `results_url`.

A Message Batch is a batch of the `/v1/messages` endpoint whose requests are kept as a
hidden file (listed by no /v1/files), each run through the Messages API's own route as
any other batch's line is (`runner.py`): the same admission, priority, retries for
"later", cancel, expiry and resuming on another replica. Unlike OpenAI's, its requests
may name several models, and each line's answer is read back in Anthropic's shapes:
`succeeded` with the message, `errored` with Anthropic's error object, `expired`, or
`canceled` (a line a cancel left unsent); its output and error files are never shown in
/v1/files. Anthropic's checks at creation are made here: a
`custom_id` of 1 to 64 letters, digits, `_` or `-`, unique in the batch; `params` an
object that asks no stream. What `params` holds past that is checked when its line runs,
and a refusal is that line's `errored` result. Times are RFC 3339, as Anthropic's.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any, cast

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.admission import Admission
from gateway.edge.anthropic.errors import error_payload
from gateway.edge.asgi import Receive, Scope
from gateway.edge.batches.routes import (
    begin,
    cancel_batch,
    found_batch,
    new_batch,
    refuse_rest,
    streamed,
)
from gateway.edge.batches.runner import BatchRunner, ids
from gateway.edge.batches.store import ENDED, BatchStore, StoredBatch, pieces
from gateway.edge.errors import APIError, invalid
from gateway.edge.openai.body import parse_json, read_body
from gateway.edge.responses.routes import guarded, json_response, team_name
from gateway.teams import team_of

MESSAGES = "/v1/messages"
ROOT = "/v1/messages/batches"
_CUSTOM_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _time(seconds: int | None) -> str | None:
    """Seconds since the epoch as RFC 3339 (Anthropic's times), or None."""
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


def message_batch(stored: StoredBatch) -> dict[str, Any]:
    """The batch as Anthropic's `message_batch` object."""
    batch, status = stored.batch, stored.status
    counts = batch["request_counts"]
    total, succeeded, failed = counts["total"], counts["completed"], counts["failed"]
    ended = status in ENDED
    errored, left = failed - stored.expired, total - succeeded - failed
    canceled = 0
    if ended and status == "failed":  # its team or requests gone: none of the rest ran
        errored += left
    elif ended:
        canceled = left
    return {
        "id": stored.id,
        "type": "message_batch",
        "processing_status": (
            "ended" if ended else "canceling" if status == "cancelling" else "in_progress"
        ),
        "request_counts": {
            "processing": 0 if ended else left,
            "succeeded": succeeded,
            "errored": errored,
            "canceled": canceled,
            "expired": stored.expired,
        },
        "ended_at": _time(batch.get(f"{status}_at")) if ended else None,
        "created_at": _time(batch["created_at"]),
        "expires_at": _time(batch["expires_at"]),
        "archived_at": None,
        "cancel_initiated_at": _time(batch["cancelling_at"]),
        # relative: the SDK joins it to its own base URL (a Host is never echoed)
        "results_url": f"{ROOT}/{stored.id}/results" if ended else None,
    }


def _requests(body: Any, max_requests: int) -> list[bytes]:
    """The body's requests as the batch's input lines, or a 400 naming the field."""
    if not isinstance(body, dict):
        raise invalid(None, "The request body must be a JSON object.")
    for name in body:
        if name != "requests":
            raise invalid(name, f"{name}: Extra inputs are not permitted")
    requests = body.get("requests")
    if not isinstance(requests, list) or not 1 <= len(requests) <= max_requests:
        raise invalid("requests", f"requests: a list of 1 to {max_requests} requests.")
    seen: set[str] = set()
    lines = []
    for i, request in enumerate(requests):
        where = f"requests.{i}"
        if not isinstance(request, dict):
            raise invalid(where, f"{where}: an object with custom_id and params.")
        for name in request:
            if name not in ("custom_id", "params"):
                raise invalid(f"{where}.{name}", f"{where}.{name}: Extra inputs are not permitted")
        custom_id, params = request.get("custom_id"), request.get("params")
        if not isinstance(custom_id, str) or not _CUSTOM_ID.fullmatch(custom_id):
            raise invalid(
                f"{where}.custom_id",
                f"{where}.custom_id: 1 to 64 letters, digits, underscores or hyphens.",
            )
        if custom_id in seen:
            raise invalid(
                f"{where}.custom_id",
                f"{where}.custom_id: '{custom_id}' is used by an earlier request.",
            )
        seen.add(custom_id)
        if not isinstance(params, dict):
            raise invalid(f"{where}.params", f"{where}.params: an object (a Messages request).")
        if params.get("stream") not in (None, False):
            raise invalid(
                f"{where}.params.stream",
                f"{where}.params.stream: a batch's messages are answered whole.",
            )
        line = {"custom_id": custom_id, "method": "POST", "url": MESSAGES, "body": params}
        lines.append(orjson.dumps(line) + b"\n")
    return lines


def _anthropic_error(response: dict[str, Any]) -> Any:
    """A refused request's error object in Anthropic's shape: as the Messages route sent
    it, or made from another (the runner's own, an answer too large to keep)."""
    body = response["body"]
    if isinstance(body, dict) and body.get("type") == "error":
        return body
    fields = body.get("error") if isinstance(body, dict) else None
    message = fields.get("message") if isinstance(fields, dict) else None
    return error_payload(response["status_code"], str(message or "The request failed."))


async def _results(store: BatchStore, team: str, stored: StoredBatch) -> AsyncIterator[bytes]:
    """The batch's results, a JSONL line a request, a page of its files at a time: what
    its lines answered, then the requests no line answered (`canceled`; `errored` with
    the batch's own error when the batch failed), read from its requests only when
    there are such (Anthropic's results come in no particular order)."""
    answered: set[str] = set()
    for file_id in (stored.output, stored.errors):
        async for page in store.pages(team, file_id):
            results = []
            for raw in page:  # a line a chunk
                line = orjson.loads(raw)
                answered.add(line["custom_id"])
                error = line["error"]
                if error is not None and error["code"] == "batch_expired":
                    result: dict[str, Any] = {"type": "expired"}
                elif error is not None:  # its answer not kept (output_too_large)
                    result = {"type": "errored", "error": error_payload(500, error["message"])}
                elif file_id == stored.output:
                    result = {"type": "succeeded", "message": line["response"]["body"]}
                else:
                    result = {"type": "errored", "error": _anthropic_error(line["response"])}
                results.append(orjson.dumps({"custom_id": line["custom_id"], "result": result}))
            if results:
                yield b"\n".join(results) + b"\n"
    if len(answered) >= int(stored.batch["request_counts"]["total"]):
        return
    unsent: dict[str, Any] = {"type": "canceled"}
    if stored.status == "failed":
        why = (stored.batch.get("errors") or {}).get("data") or [{"message": "The batch failed."}]
        error = {"type": "api_error", "message": why[0]["message"]}
        unsent = {"type": "errored", "error": {"type": "error", "error": error}}
    async for custom_ids in _custom_ids(store.pages(team, stored.batch["input_file_id"])):
        left = [c for c in custom_ids if c not in answered]
        if left:
            yield b"".join(orjson.dumps({"custom_id": c, "result": unsent}) + b"\n" for c in left)


async def _custom_ids(pages: AsyncIterator[list[bytes]]) -> AsyncIterator[list[str]]:
    """The custom ids of a Message Batch's requests (its hidden input file, checked at
    creation: a JSON object a line), a page of pieces at a time, never the whole file."""
    rest = b""
    async for page in pages:
        data = rest + b"".join(page)
        end = data.rfind(b"\n") + 1
        rest = data[end:]
        yield [orjson.loads(line)["custom_id"] for line in data[:end].splitlines() if line]
    if rest.strip():
        yield [orjson.loads(rest)["custom_id"]]


def message_batch_routes(
    runner: BatchRunner, admission: Admission, max_body: int, retry_after: int
) -> list[Route]:
    """The Message Batches API's routes, on `runner`'s store (bodies up to `max_body`:
    `batch_max_file_bytes`, a batch's requests being its input file)."""
    store, settings = runner.store, runner.settings

    async def found(request: Request) -> tuple[str, StoredBatch]:
        refuse_rest(dict(request.query_params))
        return await found_batch(store, request, "anthropic")

    async def create(request: Request) -> Response:
        refuse_rest(dict(request.query_params))
        team = team_of(request.scope)
        scope, receive = cast(Scope, request.scope), cast(Receive, request.receive)
        raw = await read_body(scope, receive, max_body, admission.bodies.meter(team))
        lines = _requests(parse_json(raw), settings.max_requests)
        name, input_id = team_name(team), ids("file-")
        content = b"".join(lines)
        hidden = {"id": input_id, "bytes": len(content)}
        await store.put_file(name, hidden, pieces(content), hidden=True)
        batch = new_batch(ids("msgbatch_"), MESSAGES, input_id, None)
        stored = StoredBatch(batch, ids("file-"), ids("file-"), api="anthropic")
        stored.batch["request_counts"]["total"] = len(lines)
        await begin(store, runner, name, stored)
        return json_response(message_batch(stored))

    async def listed(request: Request) -> Response:
        query = dict(request.query_params)
        try:
            limit = int(query.pop("limit", 20))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 1000:
            raise invalid("limit", "limit: an integer from 1 to 1000.")
        before, after = query.pop("before_id", None), query.pop("after_id", None)
        refuse_rest(query)
        batches = await store.batches(team_name(team_of(request.scope)))
        items = [message_batch(s) for s in reversed(batches) if s.api == "anthropic"]
        for cursor, name in ((after, "after_id"), (before, "before_id")):
            at = next((i for i, item in enumerate(items) if item["id"] == cursor), None)
            if cursor is not None and at is None:
                raise invalid(name, f"{name}: no message batch '{cursor[:128]}'.")
            if at is not None:  # newer ones come first: after is older, before newer
                items = items[at + 1 :] if name == "after_id" else items[:at]
        # the page next to the cursor: the first `limit` after one, the last before one
        page = items[-limit:] if before is not None else items[:limit]
        return json_response(
            {
                "data": page,
                "has_more": len(items) > limit,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
            }
        )

    async def one(request: Request) -> Response:
        team, stored = await found(request)
        if request.method == "DELETE":
            if stored.status not in ENDED:
                raise invalid(
                    None,
                    "A message batch can be deleted once it has ended; cancel it first.",
                )
            await store.delete_batch(team, stored)
            return json_response({"id": stored.id, "type": "message_batch_deleted"})
        return json_response(message_batch(stored))

    async def cancel(request: Request) -> Response:
        team, stored = await found(request)
        return json_response(message_batch(await cancel_batch(store, runner, team, stored)))

    async def results(request: Request) -> Response:
        team, stored = await found(request)
        if stored.status not in ENDED:
            raise APIError(
                400, f"Message batch {stored.id} has not ended; its results are not ready."
            )
        return await streamed(_results(store, team, stored), "application/binary")

    guard = guarded(retry_after)
    return [
        Route(ROOT, guard(create), methods=["POST"]),
        Route(ROOT, guard(listed), methods=["GET"]),
        Route(ROOT + "/{batch_id}", guard(one), methods=["GET", "DELETE"]),
        Route(ROOT + "/{batch_id}/cancel", guard(cancel), methods=["POST"]),
        Route(ROOT + "/{batch_id}/results", guard(results), methods=["GET"]),
    ]
