"""A multipart/form-data body, as OpenAI's file uploads send one (`POST /v1/files`, the
audio routes): read whole within a bound (counted against the bodies being read:
`gateway.admission.bodies`), then cut by python-multipart into its `file` part (bytes,
name, type) and its other fields, each field's values in order (a field may repeat, as
`timestamp_granularities[]` does). A body that is not a form, or that python-multipart
cannot read, is a 400.
"""

from __future__ import annotations

from typing import Any, cast

from python_multipart import MultipartParser
from python_multipart.multipart import parse_options_header

from gateway.admission.bodies import BodyMeter
from gateway.edge.asgi import Receive, Scope
from gateway.edge.errors import invalid
from gateway.edge.openai.body import read_body

#: Bytes of a multipart body past the file's own (boundaries, part headers, fields).
FORM_SLACK = 64 * 1024
#: The most parts a form may have, and headers a part: python-multipart calls back into
#: Python for each, so 300,000 one-byte fields (18 MB) held the event loop for 6.7 s.
MAX_PARTS = 64
MAX_PART_HEADERS = 16


class TooManyParts(Exception):
    """A form past `MAX_PARTS` parts, or a part past `MAX_PART_HEADERS` headers."""


class Form:
    """A multipart body's parts: the `file` part's bytes, name and type, the other fields."""

    def __init__(self) -> None:
        self.fields: dict[str, list[bytes]] = {}
        #: How many `file` parts the body held (the last is kept).
        self.files = 0
        self.filename = ""
        self.file_type = ""
        self.file = b""
        self._name = ""
        self._value: list[bytes] = []
        self._header: list[bytes] = []
        self._headers: dict[bytes, bytes] = {}
        self._parts = 0

    def parse(self, body: bytes, boundary: bytes) -> None:
        """Reads `body`'s parts (python-multipart's errors raised as they are; a form with
        too many parts stops at the first one past the bound: `TooManyParts`)."""

        def on_part_begin() -> None:
            self._parts += 1
            if self._parts > MAX_PARTS:
                raise TooManyParts(f"A form has at most {MAX_PARTS} parts.")

        def on_header_field(data: bytes, start: int, end: int) -> None:
            self._header.append(data[start:end])

        def on_header_value(data: bytes, start: int, end: int) -> None:
            self._value.append(data[start:end])

        def on_header_end() -> None:
            if len(self._headers) >= MAX_PART_HEADERS:
                raise TooManyParts(f"A part of a form has at most {MAX_PART_HEADERS} headers.")
            self._headers[b"".join(self._header).lower()] = b"".join(self._value)
            self._header, self._value = [], []

        def on_headers_finished() -> None:
            _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
            self._name = options.get(b"name", b"").decode("utf-8", "replace")
            if self._name == "file":
                self.filename = options.get(b"filename", b"").decode("utf-8", "replace")
                kind = self._headers.get(b"content-type", b"")
                self.file_type = kind.decode("latin-1").strip()

        def on_part_data(data: bytes, start: int, end: int) -> None:
            self._value.append(data[start:end])

        def on_part_end() -> None:
            value = b"".join(self._value)
            if self._name == "file":
                self.files += 1
                self.file = value
            elif self._name:
                self.fields.setdefault(self._name, []).append(value)
            self._value, self._headers = [], {}

        callbacks = {
            "on_part_begin": on_part_begin,
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_headers_finished": on_headers_finished,
            "on_part_data": on_part_data,
            "on_part_end": on_part_end,
        }
        parser = MultipartParser(boundary, cast(Any, callbacks))
        parser.write(body)
        parser.finalize()

    def field(self, name: str) -> str | None:
        """The field's first value as text, or None when the form has no such field."""
        raw = self.fields.get(name)
        return None if raw is None else raw[0].decode("utf-8", "replace")


async def read_form(
    scope: Scope, receive: Receive, limit: int, meter: BodyMeter, expected: str
) -> Form:
    """The request's form, its body at most `limit` bytes (413 past it); a body not
    declared multipart/form-data is a 400 saying what is `expected`."""
    content_type = dict(scope["headers"]).get(b"content-type", b"").decode("latin-1")
    kind, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise invalid(None, expected)
    body = await read_body(scope, receive, limit, meter)
    form = Form()
    try:
        form.parse(body, boundary)
    except TooManyParts as error:
        raise invalid(None, str(error)) from None
    except Exception as error:  # python-multipart's own errors, on a malformed body
        raise invalid(None, f"The multipart body could not be read: {error}.") from None
    return form
