"""Reads a request body as JSON, bounded in size, and refuses bad ones with 4xx.

A body over the limit is refused from its Content-Length before any of it is
read, or as soon as a chunked body passes the limit; with admission's meter
(`gateway.admission.bodies`), the bytes of all bodies being read are bounded too.
orjson rejects invalid UTF-8 and nesting deeper than it can parse, so those
become 400s here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import partial
from itertools import compress
from operator import eq, itemgetter
from typing import Any, cast

import orjson

from gateway.admission.bodies import BodyMeter
from gateway.edge.asgi import BODY_REFUSED_EXTENSION, BODY_TIMEOUT_EXTENSION, Receive, Scope
from gateway.edge.errors import APIError, invalid, request_timeout

_name, _value = itemgetter(0), itemgetter(1)


def _values(headers: Sequence[tuple[bytes, bytes]], name: bytes) -> Iterator[bytes]:
    """The values of the headers named `name`, in order, picked in C: a request has a
    dozen headers, and a Python loop over them costs each request eight bytecodes a
    header."""
    return compress(map(_value, headers), map(partial(eq, name), map(_name, headers)))


def _too_large(limit: int) -> APIError:
    return APIError(
        413, f"The request body is larger than {limit} bytes.", code="request_too_large"
    )


async def read_json(
    scope: Scope, receive: Receive, limit: int, meter: BodyMeter | None = None
) -> Any:
    """The parsed body, or an `APIError` (413 too large, 400 not JSON)."""
    body = await read_body(scope, receive, limit, meter)
    if not body:
        raise invalid(None, "The request body is empty; expected a JSON object.")
    return parse_json(body)


def parse_json(body: bytes) -> Any:
    """JSON bytes parsed, or a 400."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise invalid(None, f"The request body is not valid JSON: {error}.") from None


async def read_body(
    scope: Scope, receive: Receive, limit: int, meter: BodyMeter | None = None
) -> bytes:
    """The whole body, or an `APIError` (413 too large, 400 when the client left);
    `meter` counts the bytes of a body that is still coming while it is read (refusing
    past its bounds), from its Content-Length on."""
    declared = 0
    for value in _values(scope["headers"], b"content-length"):
        try:
            declared = int(value)
        except ValueError:
            raise invalid(None, "The Content-Length header is not a number.") from None
        if declared > limit:
            raise _too_large(limit)
    message = await receive()
    if message["type"] == "http.disconnect":
        raise _gone(scope)
    chunk: bytes = message.get("body", b"")
    if len(chunk) > limit:
        raise _too_large(limit)
    if not message.get("more_body", False):
        # Whole at once (a small body: the edge's protocol starts the task once it is):
        # its bytes are all in memory already, so there is nothing left to meter.
        return chunk
    chunks = [chunk]
    size = len(chunk)
    try:
        if meter is not None:
            meter.take(max(declared, size))
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _gone(scope)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            if meter is not None and size > meter.held:
                meter.take(size - meter.held)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
    finally:
        if meter is not None:
            meter.release()
    return b"".join(chunks)


def _gone(scope: Scope) -> APIError:
    """The refusal of a body that stopped coming: its deadline's 408, or another refusal,
    which the edge's protocol has sent (`BODY_TIMEOUT_EXTENSION`, `BODY_REFUSED_EXTENSION`),
    or a client gone."""
    extensions = scope.get("extensions", {})
    seconds = extensions.get(BODY_TIMEOUT_EXTENSION)
    if seconds is not None:
        return request_timeout("body", seconds)
    refused = extensions.get(BODY_REFUSED_EXTENSION)
    if refused is not None:
        return cast(APIError, refused)
    return APIError(400, "The client closed the connection before sending the body.")
