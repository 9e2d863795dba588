"""Bad bodies get OpenAI-shaped 4xx answers, never a 500, and take no slot."""

import socket

import pytest

from tests.support.waiting import HANG_GUARD

ROUTES = ["/v1/chat/completions", "/v1/completions"]
JSON = {"content-type": "application/json"}


def check_400(response, param=None):
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"not json",
        b'{"messages": [',
        b"\xff\xfe{}",
        b'{"prompt": "\xc3\x28"}',  # invalid UTF-8 inside a string
        b"[" * 100_000 + b"]" * 100_000,  # nesting deeper than any parser should follow
        b"[1, 2, 3]",
        b'"a string"',
        b"null",
        b"NaN",
    ],
)
def test_bad_bodies_are_400(client, route, content):
    response = client.post(route, content=content, headers={"content-type": "application/json"})
    check_400(response)


def test_deep_nesting_inside_a_valid_field_is_400(client):
    deep = b'{"prompt": "x", "extra": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b"}"
    check_400(client.post("/v1/completions", content=deep, headers=JSON))


def test_body_over_the_limit_is_413(gateway_with):
    gw = gateway_with(max_body_bytes=1000)
    import httpx

    big = {"prompt": "x" * 2000}
    response = httpx.post(gw.url + "/v1/completions", json=big, timeout=HANG_GUARD)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"

    def chunks():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 200
        yield b'"}'

    response = httpx.post(
        gw.url + "/v1/completions", content=chunks(), headers=JSON, timeout=HANG_GUARD
    )
    assert response.status_code == 413
    assert httpx.post(gw.url + "/v1/completions", json={"prompt": "x"}).status_code == 200


def test_413_comes_before_the_body_is_read(gateway):
    """A declared 1 GB body is refused from its header: the gateway answers
    while the client has sent almost none of it."""
    host, port = gateway.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=HANG_GUARD) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            b"content-type: application/json\r\n"
            b'content-length: 1000000000\r\n\r\n{"prompt": "'
        )
        reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 413")
    assert b"request_too_large" in reply


TEXT = [{"role": "user", "content": "x"}]
UNHASHABLE_TYPES = [
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": []}]}]},
        "messages[0].content[0]",
    ),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": {}}]}]}, None),
    ("/v1/responses", {"input": [{"type": [], "role": "user", "content": "x"}]}, "input[0].type"),
    ("/v1/responses/input_tokens", {"input": [{"type": {}}]}, "input[0].type"),
    ("/v1/conversations", {"items": [{"type": []}]}, "items[0].type"),
    ("/v1/messages", {"max_tokens": 5, "messages": TEXT, "thinking": {"type": []}}, None),
    ("/v1/messages/count_tokens", {"messages": TEXT, "thinking": {"type": {}}}, None),
]


@pytest.mark.parametrize(
    ("route", "fields", "param"), UNHASHABLE_TYPES, ids=[route for route, _, _ in UNHASHABLE_TYPES]
)
def test_a_type_that_is_a_list_or_an_object_is_400(client, route, fields, param):
    # looked up in a set or a dict of the known types, it had raised TypeError: a 500
    body = {"model": "furnace-demo", **fields}
    response = client.post(route, json=body, headers={"anthropic-version": "2023-06-01"})
    assert response.status_code == 400, response.text
    if route.startswith("/v1/messages"):  # Anthropic's shape
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert "thinking.type" in error["message"]
    elif param is not None:
        assert response.json()["error"]["param"] == param
