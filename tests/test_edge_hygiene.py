"""The edge holds the line: JSON-only bodies, no slash redirects, Host checks,
OpenAI-shaped answers to bytes that are not HTTP, no protocol upgrades, fixed
messages for server-side failures, one 404 for unseen and unknown models, and
config errors that never print the offending line."""

import json
import logging
import secrets
import socket
import time
from email.utils import parsedate_to_datetime

import httptools
import httpx
import pytest

from gateway.config import ConfigError, load_config, parse_config
from gateway.worker.demo import DEMO_MODEL
from tests.support.keys import bearer, keyed, new_key
from tests.support.raw_http import connect, read_to_end
from tests.support.requests import sse_events
from tests.support.scripted_worker import SCRIPTED_MODEL, script
from tests.support.waiting import HANG_GUARD

SECRET = "postgres://admin:hunter2@db.internal:5432/furnace"


def _port(url: str) -> str:
    return url.rsplit(":", 1)[1]


# -- JSON-only bodies ---------------------------------------------------------


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "text/json"]
)
def test_a_body_not_declared_json_is_415_and_reaches_no_worker(client, workers, content_type):
    request_id = secrets.token_hex(8)
    headers = {"x-request-id": request_id}
    if content_type is not None:
        headers["content-type"] = content_type
    body = b'{"model": "scripted", "prompt": "x"}'
    for path in ("/v1/completions", "/v1/chat/completions", "/rerank", "/score", "/v2/rerank"):
        response = client.post(path, content=body, headers=headers)
        assert response.status_code == 415, response.text
        assert response.json() == {
            "error": {
                "message": response.json()["error"]["message"],
                "type": "invalid_request_error",
                "param": None,
                "code": "unsupported_media_type",
            }
        }
    assert request_id not in workers.scripted.calls


def test_json_with_parameters_is_served(client):
    response = client.post(
        "/v1/completions",
        content=b'{"model": "scripted", "prompt": "x"}',
        headers={"content-type": "Application/JSON; charset=utf-8"},
    )
    assert response.status_code == 200, response.text


# -- the Date header ---------------------------------------------------------


def test_every_answer_says_the_date_and_no_server_name(gateway, client):
    answers = [
        client.post("/v1/completions", json={"model": "scripted", "prompt": "x"}),
        client.get("/v1/models"),
        client.post("/v1/completions", content=b"{}", headers={"content-type": "text/plain"}),
    ]
    with connect(gateway.url) as sock:  # a refusal of the HTTP protocol's own
        sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n" + b"x-many: 1\r\n" * 500 + b"\r\n")
        refused = read_to_end(sock)
    head = refused.split(b"\r\n\r\n", 1)[0].decode("latin-1").lower()
    assert head.startswith("http/1.1 431")
    dates = [answer.headers["date"] for answer in answers]
    dates.append(head.split("\r\ndate: ", 1)[1].split("\r\n", 1)[0])
    for date in dates:  # RFC 9110's IMF-fixdate, this second's (give or take a few)
        assert date.endswith(" gmt") or date.endswith(" GMT")
        assert abs(parsedate_to_datetime(date).timestamp() - time.time()) < 10
    assert not any("server" in answer.headers for answer in answers)


# -- no slash redirects -------------------------------------------------------


def test_a_whole_answer_says_its_length_and_an_http_1_0_client_gets_no_chunks(gateway):
    """A whole answer or refusal carries `content-length`; an HTTP/1.0 request (which
    cannot read chunks, RFC 9112 6.1) gets the body as it is, then the close."""
    host, port = "127.0.0.1", int(_port(gateway.url))
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "x y"}]}' % (
        DEMO_MODEL.encode()
    )
    for path, status in ((b"/v1/chat/completions", b"200"), (b"/v1/completions", b"400")):
        head = b"POST %s HTTP/1.0\r\nHost: %s:%d\r\n" % (path, host.encode(), port)
        head += b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
        with socket.create_connection((host, port), timeout=HANG_GUARD) as sock:
            sock.sendall(head + body)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        top, _, payload = answer.partition(b"\r\n\r\n")
        lines = top.lower().split(b"\r\n")
        assert lines[0].split()[1] == status
        assert b"transfer-encoding: chunked" not in lines
        assert b"content-length: %d" % len(payload) in lines
        assert json.loads(payload)


@pytest.mark.parametrize("connection", [b"", b"Connection: keep-alive\r\n"])
def test_an_http_1_0_client_gets_a_stream_close_delimited_not_chunked(gateway, connection):
    """A stream has no length to declare: to an HTTP/1.0 request (even one asking to keep
    the connection) its events go out as they are and the close ends them (RFC 9112 6.3),
    as the SDKs' parsers and ApacheBench read them; HTTP/1.1 keeps its chunks."""
    host, port = "127.0.0.1", int(_port(gateway.url))
    body = b'{"model": "%s", "stream": true, "messages": [{"role": "user", "content": "a b c"}]}'
    body %= DEMO_MODEL.encode()
    answers = {}
    for version in (b"1.0", b"1.1"):
        head = b"POST /v1/chat/completions HTTP/%s\r\nHost: %s:%d\r\n" % (
            version,
            host.encode(),
            port,
        )
        head += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
        head += connection if version == b"1.0" else b"Connection: close\r\n"
        with connect(gateway.url) as sock:
            sock.sendall(head + b"\r\n" + body)
            answers[version] = read_to_end(sock)  # the gateway closes: the body's end
    top, _, payload = answers[b"1.0"].partition(b"\r\n\r\n")
    lines = top.lower().split(b"\r\n")
    assert lines[0].split()[1] == b"200"
    assert b"transfer-encoding: chunked" not in lines
    assert b"connection: close" in lines
    assert not any(line.startswith(b"content-length") for line in lines)
    assert payload.startswith(b"data: ") and payload.endswith(b"data: [DONE]\n\n")
    events = sse_events(payload.decode())
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    chunked = answers[b"1.1"].partition(b"\r\n\r\n")[0].lower().split(b"\r\n")
    assert b"transfer-encoding: chunked" in chunked


def test_a_trailing_slash_is_a_plain_404(client):
    for response in (
        client.post("/v1/completions/", json={"prompt": "x"}, headers={"host": "evil.example"}),
        client.post("/v1/completions/", json={"prompt": "x"}),
        client.get("/v1/models/"),
    ):
        assert response.status_code in (404, 421)
        assert "location" not in response.headers
    assert client.get("/v1/models/").status_code == 404


# -- Host checks --------------------------------------------------------------


def test_on_loopback_only_loopback_names_are_served(gateway, client):
    port = _port(gateway.url)
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST."):
        assert client.get("/v1/models", headers={"host": host}).status_code == 200, host
    for host in (f"evil.example:{port}", "attacker.test", f"10.0.0.1:{port}"):
        response = client.get("/v1/models", headers={"host": host})
        assert response.status_code == 421, host
        assert response.json()["error"]["code"] == "misdirected_request"
        assert host not in response.text
    # the probes and the metrics answer any Host (kubelet and Prometheus use the IP)
    for path in ("/health", "/metrics"):
        assert client.get(path, headers={"host": "10.1.2.3:8000"}).status_code == 200


def test_allowed_hosts_are_the_only_names_served(gateway_with):
    gw = gateway_with(allowed_hosts=("api.example.com",))
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
        ok = http.get("/v1/models", headers={"host": "API.example.com:443"})
        assert ok.status_code == 200
        for host in ("localhost", f"127.0.0.1:{_port(gw.url)}", "example.com"):
            assert http.get("/v1/models", headers={"host": host}).status_code == 421


def test_allowed_hosts_from_yaml_and_the_environment():
    assert parse_config({"allowed_hosts": ["A.example.", "[::1]"]}, env={}).allowed_hosts == (
        "a.example",
        "::1",
    )
    env = {"FURNACE_ALLOWED_HOSTS": "a.example, b.example"}
    assert parse_config({}, env=env).allowed_hosts == ("a.example", "b.example")
    with pytest.raises(ConfigError, match="allowed_hosts"):
        parse_config({"allowed_hosts": [""]}, env={})


# -- bytes that are not HTTP, and upgrades ------------------------------------

HOST = b"Host: 127.0.0.1\r\n"


class _Answers:
    """Whole responses read off one connection (status, headers, body), in order."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.parser = httptools.HttpResponseParser(self)
        self.done: list[tuple[int, dict[bytes, bytes], bytes]] = []
        self.headers: dict[bytes, bytes] = {}
        self.body = b""

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.done.append((self.parser.get_status_code(), self.headers, self.body))
        self.headers, self.body = {}, b""

    def next(self) -> tuple[int, dict[bytes, bytes], bytes]:
        while not self.done:
            data = self.sock.recv(65536)
            assert data, "the gateway closed the connection"
            self.parser.feed_data(data)
        return self.done.pop(0)


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /v1/completions HTTP/1.1\r\n" + HOST + b"Content-Type: application/json\r\n"
        b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"GET /v1/models HTTP/1.1\r\n" + HOST + b"X-A: b\r\n  folded\r\n\r\n",
        b"BREW /v1/models HTTP/1.1\r\n" + HOST + b"\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    ],
    ids=["length-and-chunked", "line-folding", "unknown-method", "http2-preface"],
)
def test_bytes_that_are_not_http_get_a_400_in_openai_shape(gateway, request_bytes):
    with connect(gateway.url) as sock:
        sock.sendall(request_bytes)
        answer = read_to_end(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), answer
    assert b"content-type: application/json" in head.lower().split(b"\r\n")
    error = json.loads(body)["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, None)


def test_bytes_that_are_not_http_behind_a_stream_close_it_without_an_answer_inside(gateway):
    # an answer written then would land inside the stream's chunks; the stream's
    # generation is cancelled with the connection (the leak check after the test)
    body = json.dumps(
        {"model": "furnace-slow", "prompt": "a " * 200, "max_tokens": 200, "stream": True}
    ).encode()
    with connect(gateway.url) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\n" + HOST + b"Content-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        answers = _Answers(sock)
        while b"data: " not in answers.body:
            answers.parser.feed_data(sock.recv(65536))
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        answers.parser.feed_data(read_to_end(sock))  # the stream's chunks, cut: nothing else
    assert b"HTTP/1.1" not in answers.body
    assert not answers.done


def test_a_request_that_asks_for_an_upgrade_is_answered_over_http_1_1(gateway):
    # h2c (`curl --http2` on an http:// URL) or WebSocket: the gateway speaks neither and
    # answers as if not asked (RFC 9110 7.8), the body read, the connection kept
    h2c = (
        b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
        b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"
    )
    websocket = (
        b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    )
    body = json.dumps({"model": DEMO_MODEL, "messages": [{"role": "user", "content": "x y"}]})
    with connect(gateway.url) as sock:
        answers = _Answers(sock)
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\n"
            + HOST
            + h2c
            + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
            + body.encode()
        )
        status, _, answer = answers.next()
        assert status == 200, answer
        assert json.loads(answer)["choices"][0]["message"]["content"] == "x y"
        sock.sendall(b"GET /v1/models HTTP/1.1\r\n" + HOST + websocket + b"\r\n")
        status, _, answer = answers.next()
        assert status == 200, answer
        assert json.loads(answer)["object"] == "list"
        # on Anthropic's path, its shape: a GET there is 405
        sock.sendall(b"GET /v1/messages HTTP/1.1\r\n" + HOST + websocket + b"\r\n")
        status, headers, answer = answers.next()
        assert (status, json.loads(answer)["type"]) == (405, "error")
        assert headers[b"content-type"] == b"application/json"
        assert headers[b"allow"] == b"POST"


# -- fixed messages for server-side failures ----------------------------------

SERVER_SIDE = [
    ("INTERNAL", 500, "engine_error"),
    ("UNAVAILABLE", 503, "engine_unavailable"),
    ("UNAUTHENTICATED", 502, "engine_auth_failed"),
    ("DEADLINE_EXCEEDED", 504, "timeout"),
]


@pytest.mark.parametrize(("grpc_status", "status", "code"), SERVER_SIDE)
def test_a_workers_message_reaches_the_log_not_the_client(
    client, caplog, grpc_status, status, code
):
    caplog.set_level(logging.WARNING, logger="furnace.edge")
    request_id = secrets.token_hex(8)
    response = client.post(
        "/v1/completions",
        json={"model": SCRIPTED_MODEL, "prompt": script(status=grpc_status, message=SECRET)},
        headers={"x-request-id": request_id},
    )
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == code
    assert "hunter2" not in response.text
    assert error["message"].startswith("The ")
    logged = [r.getMessage() for r in caplog.records if request_id in r.getMessage()]
    assert any("hunter2" in line for line in logged), logged


def test_a_failure_mid_stream_sends_the_fixed_message(client, caplog):
    caplog.set_level(logging.WARNING, logger="furnace.edge")
    messages = [{"role": "user", "content": script(texts=1, status="INTERNAL", message=SECRET)}]
    response = client.post(
        "/v1/chat/completions",
        json={"model": SCRIPTED_MODEL, "messages": messages, "stream": True},
    )
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "engine_error"
    assert "hunter2" not in response.text
    assert any("hunter2" in r.getMessage() for r in caplog.records)


def test_a_refusal_of_the_clients_input_keeps_its_message_bounded(client):
    response = client.post(
        "/v1/completions",
        json={"model": SCRIPTED_MODEL, "prompt": script(status="INVALID_ARGUMENT", param="top_k")},
    )
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "scripted INVALID_ARGUMENT"
    long = "x" * 5000
    response = client.post(
        "/v1/completions",
        json={
            "model": SCRIPTED_MODEL,
            "prompt": script(status="INVALID_ARGUMENT", param="top_k", message=long),
        },
    )
    assert response.status_code == 400
    assert len(response.json()["error"]["message"]) == 512


# -- one 404 for unseen and unknown models ------------------------------------


def test_a_hidden_model_reads_as_a_missing_one(gateway_with):
    key = new_key("search")
    gw = gateway_with(**keyed({"search": {"models": [DEMO_MODEL]}}, {key: "search"}))
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD, headers=bearer(key)) as http:
        missing = http.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        assert missing.status_code == 404
        # a tensor model (was 400 model_not_supported) and an LLM past a cap of its own
        for model, extra in (("resnet-50", {}), ("furnace-slow", {"max_tokens": 10**9})):
            hidden = http.post("/v1/completions", json={"model": model, "prompt": "x", **extra})
            assert hidden.status_code == 404, hidden.text
            assert hidden.json() == {
                "error": {
                    **missing.json()["error"],
                    # the same words, the same models listed: nothing tells them apart
                    "message": missing.json()["error"]["message"].replace("`nope`", f"`{model}`"),
                }
            }


def test_a_request_without_model_takes_the_teams_first_model(gateway_with):
    scripted, tensor = new_key("scripted"), new_key("tensor")
    teams = {"scripted": {"models": [SCRIPTED_MODEL]}, "tensor": {"models": ["resnet-50"]}}
    gw = gateway_with(**keyed(teams, {scripted: "scripted", tensor: "tensor"}))
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
        ok = http.post("/v1/completions", json={"prompt": "x y"}, headers=bearer(scripted))
        assert ok.status_code == 200, ok.text
        assert ok.json()["model"] == SCRIPTED_MODEL
        none = http.post("/v1/completions", json={"prompt": "x y"}, headers=bearer(tensor))
        assert none.status_code == 404
        assert none.json()["error"]["code"] == "model_not_found"
        for name in (DEMO_MODEL, "furnace-slow", SCRIPTED_MODEL):
            assert name not in none.text


# -- config errors ------------------------------------------------------------


def test_a_yaml_error_names_the_place_not_the_line(tmp_path):
    bad = tmp_path / "config.yaml"
    bad.write_text("port: 8000\nredis_url: redis://:hunter2@redis:6379 [\n  - x: : y\n")
    with pytest.raises(ConfigError, match="line") as raised:
        load_config(bad, env={})
    assert "hunter2" not in str(raised.value)
    keys = tmp_path / "keys.yaml"
    keys.write_text("- sha256: hunter2hunter2\n  team: [a\n")
    with pytest.raises(ConfigError, match="keys_file") as raised:
        parse_config({"teams": {"a": {}}, "keys_file": str(keys)}, env={})
    assert "hunter2" not in str(raised.value)
