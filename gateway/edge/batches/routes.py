"""OpenAI's Files and Batch APIs, for batch files: `POST /v1/files` (multipart, purpose
`batch`), `GET /v1/files`, `GET|DELETE /v1/files/{id}`, `GET /v1/files/{id}/content`;
`POST /v1/batches`, `GET /v1/batches`, `GET /v1/batches/{id}`, `POST
/v1/batches/{id}/cancel`. A team sees only its own files and batches (another's id is a
404, as an id that never was); an open gateway's are one team's.

An upload is read whole (at most `batch_max_file_bytes`, counted against the bodies being
read as any body is: `gateway.admission.bodies`), its `file` part kept in 1 MiB chunks.
Purposes other than `batch` are refused by name (nothing here reads them). The batch
endpoints are those this gateway serves: chat, completions, embeddings, responses, rerank
and score.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any, cast

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from gateway.admission import Admission
from gateway.edge.asgi import Receive, Scope
from gateway.edge.batches.runner import BatchRunner, ids
from gateway.edge.batches.store import UNFINISHED, BatchStore, StoredBatch, pieces
from gateway.edge.errors import APIError, invalid
from gateway.edge.forms import FORM_SLACK, read_form
from gateway.edge.openai.body import parse_json, read_body
from gateway.edge.responses.params import _metadata
from gateway.edge.responses.routes import guarded, json_response, refuse_query, team_name
from gateway.teams import team_of

#: The endpoints a batch may name (OpenAI's, and vLLM's batch runner's rerank and score).
ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/rerank",
    "/v1/score",
)
#: The one completion window (OpenAI's), and its seconds.
WINDOW, WINDOW_SECONDS = "24h", 24 * 3600
#: `expires_after.seconds`' range (OpenAI's: an hour to 30 days).
EXPIRES_MIN, EXPIRES_MAX = 3600, 2_592_000


def not_found(kind: str, object_id: str) -> APIError:
    """The 404 of an id the team does not have."""
    return APIError(404, f"No such {kind}: '{object_id[:128]}'.", code="not_found", param="id")


async def found_batch(store: BatchStore, request: Request, api: str) -> tuple[str, StoredBatch]:
    """The team's name and its batch the path names, made with `api`, or a 404."""
    team, batch_id = team_name(team_of(request.scope)), request.path_params["batch_id"]
    stored = await store.batch(team, batch_id)
    if stored is None or stored.api != api:
        raise not_found("batch" if api == "openai" else "message batch", batch_id)
    return team, stored


def new_batch(
    batch_id: str, endpoint: str, file_id: str, metadata: dict[str, str] | None
) -> dict[str, Any]:
    """A new batch's object (OpenAI's), `validating`."""
    now = int(time.time())
    return {
        "id": batch_id,
        "object": "batch",
        "endpoint": endpoint,
        "model": None,
        "errors": None,
        "input_file_id": file_id,
        "completion_window": WINDOW,
        "status": "validating",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": now,
        "in_progress_at": None,
        "expires_at": now + WINDOW_SECONDS,
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "usage": None,
        "metadata": metadata,
    }


async def begin(store: BatchStore, runner: BatchRunner, team: str, stored: StoredBatch) -> None:
    """Keeps a new batch and starts its run here."""
    await store.put_batch(team, stored)
    await runner.begin(team, stored.id)


async def cancel_batch(
    store: BatchStore, runner: BatchRunner, team: str, found: StoredBatch
) -> StoredBatch:
    """The batch cancelled (`cancelling` until its run ends its lines), or as it was
    when it is cancelled already; a 409 when it has ended."""
    if found.status in ("cancelling", "cancelled"):
        return found
    if found.status not in UNFINISHED:
        raise APIError(
            409, f"Cannot cancel a batch that is {found.status}.", param="batch_id", code="conflict"
        )
    batch = {**found.batch, "status": "cancelling", "cancelling_at": int(time.time())}
    cancelling = replace(found, batch=batch)
    if await store.update(team, cancelling, ("validating", "in_progress")) is None:
        raise not_found("batch", found.id)
    runner.cancel(team, found.id)
    return await store.batch(team, found.id) or cancelling


def _page(request: Request, most: int, default: int) -> tuple[int, str, str | None, dict[str, str]]:
    """The query's `limit`, `order`, `after` (and the rest of it), or a 400 naming one."""
    query = {k: v for k, v in request.query_params.items()}
    try:
        limit = int(query.pop("limit", default))
    except ValueError:
        limit = 0
    if not 1 <= limit <= most:
        raise invalid("limit", f"Invalid 'limit': an integer from 1 to {most}.")
    order = query.pop("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("order", "Invalid 'order': asc or desc.")
    return limit, order, query.pop("after", None), query


def _listed(items: list[dict[str, Any]], limit: int, order: str, after: str | None) -> Response:
    """A page of `items` (oldest first) as OpenAI's list object."""
    if order == "desc":
        items = items[::-1]
    if after is not None:
        at = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if at is None:
            raise invalid("after", f"No object with id '{after[:128]}'.")
        items = items[at + 1 :]
    page = items[:limit]
    return json_response(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    )


def _expires_after(value: Any, param: str) -> int | None:
    """`expires_after`'s seconds (anchor `created_at`), or a 400 naming the field."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("anchor") != "created_at":
        raise invalid(f"{param}.anchor", f"Invalid '{param}': anchor must be 'created_at'.")
    seconds = value.get("seconds")
    if type(seconds) is not int or not EXPIRES_MIN <= seconds <= EXPIRES_MAX:
        raise invalid(
            f"{param}.seconds",
            f"Invalid '{param}.seconds': an integer from {EXPIRES_MIN} to {EXPIRES_MAX}.",
        )
    return seconds


async def _chunks(pages: AsyncIterator[list[bytes]]) -> AsyncIterator[bytes]:
    async for page in pages:
        for chunk in page:
            yield chunk


async def streamed(chunks: AsyncIterator[bytes], media_type: str) -> StreamingResponse:
    """A download of `chunks` as the store reads them (a page at a time, never the whole
    file), chunked. Its first read comes before the answer begins, so a store failing
    then is the route's 503; one failing later cuts the download (no last chunk)."""
    first = await anext(chunks, b"")

    async def body() -> AsyncIterator[bytes]:
        yield first
        async for chunk in chunks:
            yield chunk

    return StreamingResponse(body(), media_type=media_type)


def batch_routes(
    runner: BatchRunner, admission: Admission, max_file: int, retry_after: int
) -> list[Route]:
    """The Files and Batch APIs' routes, on `runner`'s store."""
    store = runner.store
    storing = guarded(retry_after)

    async def upload(request: Request) -> Response:
        refuse_query(request)
        team = team_of(request.scope)
        meter = admission.bodies.meter(team)
        scope, receive = cast(Scope, request.scope), cast(Receive, request.receive)
        expected = "Upload a file as multipart/form-data, with 'file' and 'purpose'."
        form = await read_form(scope, receive, max_file + FORM_SLACK, meter, expected)
        purpose = form.field("purpose")
        if purpose is None:
            raise invalid("purpose", "Missing required parameter: 'purpose'.")
        if purpose != "batch":
            raise invalid(
                "purpose", f"Only files of purpose 'batch' are served here, not '{purpose[:64]}'."
            )
        if not form.files:
            raise invalid("file", "Missing required parameter: 'file'.")
        if form.files > 1:
            raise invalid("file", "Upload one file a request.")
        size = len(form.file)
        if size > max_file:
            raise APIError(
                413,
                f"The file is larger than {max_file} bytes.",
                param="file",
                code="file_too_large",
            )
        seconds = None
        if "expires_after[anchor]" in form.fields or "expires_after[seconds]" in form.fields:
            raw = form.field("expires_after[seconds]") or ""
            expires = {
                "anchor": form.field("expires_after[anchor]"),
                "seconds": int(raw) if raw.isdigit() else raw,
            }
            seconds = _expires_after(expires, "expires_after")
        unknown = sorted(
            set(form.fields) - {"purpose", "expires_after[anchor]", "expires_after[seconds]"}
        )
        if unknown:
            raise invalid(unknown[0], f"Unrecognized parameter: '{unknown[0][:64]}'.")
        now = int(time.time())
        file = {
            "id": ids("file-"),
            "object": "file",
            "bytes": size,
            "created_at": now,
            # as kept: its `expires_after`, else the store's `batch_ttl`
            "expires_at": now + (int(store.ttl) if seconds is None else seconds),
            "filename": form.filename[:256] or "upload.jsonl",
            "purpose": "batch",
            "status": "processed",
            "status_details": None,
        }
        await store.put_file(team_name(team), file, pieces(form.file), seconds)
        return json_response(file)

    async def list_files(request: Request) -> Response:
        limit, order, after, rest = _page(request, 10_000, 10_000)
        purpose = rest.pop("purpose", None)
        refuse_rest(rest)
        files = await store.files(team_name(team_of(request.scope)))
        if purpose is not None:
            files = [f for f in files if f["purpose"] == purpose]
        return _listed(files, limit, order, after)

    async def one_file(request: Request) -> Response:
        refuse_query(request)
        team, file_id = team_name(team_of(request.scope)), request.path_params["file_id"]
        if request.method == "DELETE":
            if not await store.delete_file(team, file_id):
                raise not_found("file", file_id)
            return json_response({"id": file_id, "object": "file", "deleted": True})
        found = await store.file(team, file_id)
        if found is None:
            raise not_found("file", file_id)
        return json_response(found)

    async def content(request: Request) -> Response:
        refuse_query(request)
        team, file_id = team_name(team_of(request.scope)), request.path_params["file_id"]
        found = await store.file(team, file_id)
        if found is None:
            raise not_found("file", file_id)
        return await streamed(_chunks(store.pages(team, file_id)), "application/octet-stream")

    async def create(request: Request) -> Response:
        refuse_query(request)
        team = team_of(request.scope)
        meter = admission.bodies.meter(team)
        body = parse_json(
            await read_body(
                cast(Scope, request.scope), cast(Receive, request.receive), 1024 * 1024, meter
            )
        )
        if not isinstance(body, dict):
            raise invalid(None, "The request body must be a JSON object.")
        known = {
            "input_file_id",
            "endpoint",
            "completion_window",
            "metadata",
            "output_expires_after",
        }
        for name in body:
            if name not in known:
                raise invalid(name, f"Unrecognized request argument supplied: {name[:64]}")
        file_id, endpoint = body.get("input_file_id"), body.get("endpoint")
        if not isinstance(file_id, str) or not file_id:
            raise invalid("input_file_id", "Missing required parameter: 'input_file_id'.")
        if endpoint not in ENDPOINTS:
            raise invalid(
                "endpoint",
                f"Invalid 'endpoint': one of {', '.join(ENDPOINTS)}.",
            )
        if body.get("completion_window") != WINDOW:
            raise invalid(
                "completion_window", f"Invalid 'completion_window': only '{WINDOW}' is supported."
            )
        metadata = _metadata(body) or None
        output_seconds = _expires_after(body.get("output_expires_after"), "output_expires_after")
        name = team_name(team)
        found = await store.file(name, file_id)
        if found is None:
            raise invalid("input_file_id", f"No such file: '{file_id[:128]}'.")
        if found["purpose"] != "batch":
            raise invalid("input_file_id", "The input file's purpose must be 'batch'.")
        batch = new_batch(ids("batch_"), endpoint, file_id, metadata)
        await begin(
            store, runner, name, StoredBatch(batch, ids("file-"), ids("file-"), output_seconds)
        )
        return json_response(batch)

    async def list_batches(request: Request) -> Response:
        limit, order, after, rest = _page(request, 100, 20)
        refuse_rest(rest)
        found = await store.batches(team_name(team_of(request.scope)))
        return _listed([s.batch for s in found if s.api == "openai"], limit, order, after)

    async def found(request: Request) -> tuple[str, StoredBatch]:
        refuse_query(request)
        return await found_batch(store, request, "openai")

    async def one_batch(request: Request) -> Response:
        return json_response((await found(request))[1].batch)

    async def cancel(request: Request) -> Response:
        team, stored = await found(request)
        return json_response((await cancel_batch(store, runner, team, stored)).batch)

    return [
        Route("/v1/files", storing(upload), methods=["POST"]),
        Route("/v1/files", storing(list_files), methods=["GET"]),
        Route("/v1/files/{file_id}", storing(one_file), methods=["GET", "DELETE"]),
        Route("/v1/files/{file_id}/content", storing(content), methods=["GET"]),
        Route("/v1/batches", storing(create), methods=["POST"]),
        Route("/v1/batches", storing(list_batches), methods=["GET"]),
        Route("/v1/batches/{batch_id}", storing(one_batch), methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", storing(cancel), methods=["POST"]),
    ]


def refuse_rest(rest: dict[str, str]) -> None:
    """A query parameter not served, refused by name."""
    for name in rest:
        raise invalid(name, f"Unrecognized query parameter: '{name[:64]}'.")
