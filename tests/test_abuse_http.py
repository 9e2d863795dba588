"""Specs: the HTTP bounds before the app (gateway/edge/http_protocol.py): the head's
size and header count, the head's and the body's deadlines, the connection cap."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import httpx
import pytest

from tests.support.keys import bearer, keyed, new_key
from tests.support.metrics import access_lines
from tests.support.raw_http import connect, read_to_end
from tests.support.waiting import HANG_GUARD, wait_until


def status_and_error(answer: bytes) -> tuple[int, dict[str, str]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def flooded(sock: socket.socket) -> bytes:
    """Sends 1 MiB more of a field's value (unless the gateway answers first), then
    reads the answer."""
    try:
        for _ in range(64):
            sock.sendall(b"a" * 16384)
    except (BrokenPipeError, ConnectionResetError):
        pass
    return read_to_end(sock)


def test_a_huge_header_is_refused_early(gateway_with):
    gw = gateway_with(max_header_bytes=4096)
    with connect(gw.url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nx-big: ")
        answer = flooded(sock)
    status, error = status_and_error(answer)
    assert status == 431
    assert error["code"] == "request_headers_too_large"


def test_too_many_headers(gateway_with):
    gw = gateway_with()
    headers = {f"x-h{i}": "v" for i in range(200)}
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        answer = client.get("/health", headers=headers)
        assert answer.status_code == 431
        assert answer.json()["error"]["code"] == "request_headers_too_large"
        assert client.get("/health", headers={f"x-h{i}": "v" for i in range(50)}).is_success


def test_a_chunked_bodys_framing_is_bounded_as_a_head_is(gateway_with, caplog):
    # httptools gathers a trailer field's value by concatenation: one endless field had
    # grown the process by hundreds of megabytes and held the event loop for seconds a read
    caplog.set_level(logging.INFO, logger="furnace.access")
    gw = gateway_with(max_header_bytes=4096, body_timeout=5)
    body = b'{"prompt": "a b"}'
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    with connect(gw.url) as sock:
        framed = b"%x\r\n%s\r\n0\r\nx-trailer: " % (len(body), body)
        sock.sendall(head.replace(b"\r\n\r\n", b"\r\nx-request-id: framing-1\r\n\r\n") + framed)
        answer = flooded(sock)
    status, error = status_and_error(answer)
    assert (status, error["code"]) == (431, "request_headers_too_large")
    bodies = gw.state.admission.bodies
    wait_until(lambda: bodies.in_flight == 0, "the refused body's bytes given back")
    wait_until(lambda: access_lines(caplog), "the request's access-log line")
    [line] = access_lines(caplog)
    assert (line["request_id"], line["status"]) == ("framing-1", 431)  # what the client got
    # within the bound: trailers read (and dropped), chunk extensions, a body in chunks
    # of a byte (framing far past the bound in all, but each piece with its body bytes)
    spaced = b" " * 8000 + body
    chunks = b"".join(b"1;ext=%d\r\n%c\r\n" % (i, c) for i, c in enumerate(spaced))
    with connect(gw.url) as sock:
        sock.sendall(head + chunks + b"0\r\nx-trailer: " + b"t" * 2000 + b"\r\n\r\n")
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200 "), answer


@pytest.mark.parametrize("path", [b"/v1/messages", b"/v1/messages/count_tokens?beta=true"])
def test_on_anthropics_paths_these_refusals_are_in_its_shape(gateway_with, path):
    gw = gateway_with(max_header_bytes=4096, body_timeout=0.5)
    head = b"POST %s HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n" % path
    answers = []
    with connect(gw.url) as sock:  # a body that never comes whole
        sock.sendall(head + b"content-length: 100\r\n\r\n{")
        answers.append(read_to_end(sock))
    with connect(gw.url) as sock:  # a head too large
        sock.sendall(head + b"x-big: " + b"a" * 8192 + b"\r\n\r\n")
        answers.append(read_to_end(sock))
    with connect(gw.url) as sock:  # not HTTP/1.1
        sock.sendall(head + b"content-length: 1\r\ntransfer-encoding: chunked\r\n\r\n")
        answers.append(read_to_end(sock))
    for answer, status in zip(answers, (408, 431, 400), strict=True):
        top, _, body = answer.partition(b"\r\n\r\n")
        assert top.startswith(b"HTTP/1.1 %d " % status), answer
        error = json.loads(body)
        assert (error["type"], error["error"]["type"]) == ("error", "invalid_request_error")
        assert error["error"]["message"]


def test_a_slow_loris_is_cut_at_the_deadline(gateway_with):
    gw = gateway_with(header_timeout=1)
    request = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n" + b"x-a: b\r\n" * 100
    with connect(gw.url) as sock:
        closed = False
        for byte in request:  # far longer than the deadline
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            time.sleep(0.2)
            sock.setblocking(False)
            try:
                if sock.recv(65536, socket.MSG_PEEK):
                    closed = True
                    break
            except BlockingIOError:
                pass
            except ConnectionResetError:
                closed = True
                break
            finally:
                sock.setblocking(True)
                sock.settimeout(HANG_GUARD)
        assert closed
        answer = read_to_end(sock)
    if answer:
        status, error = status_and_error(answer)
        assert status == 408
        assert error["code"] == "request_timeout"


def test_a_silent_connection_is_closed(gateway_with):
    gw = gateway_with(header_timeout=0.5)
    with connect(gw.url) as sock:
        assert read_to_end(sock) == b""


def test_an_unfinished_body_is_dropped_without_a_slot(gateway_with):
    gw = gateway_with(body_timeout=1)
    with connect(gw.url) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n" + b'{"prompt": "'
        )
        answer = read_to_end(sock)
    status, error = status_and_error(answer)
    assert status == 408
    assert error["code"] == "request_timeout"
    assert gw.state.slots.in_use == 0
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        assert client.post("/v1/completions", json={"prompt": "a b"}).is_success


@pytest.mark.parametrize("declared", [100, 200_000], ids=["small", "large"])
def test_a_body_that_never_comes_whole_leaves_its_408_in_the_access_log(
    gateway_with, caplog, declared
):
    # a small body's task starts once the body is whole, a large one's at its head:
    # both are recorded as the 408 the client got, with their route
    caplog.set_level(logging.INFO, logger="furnace.access")
    gw = gateway_with(body_timeout=0.5)
    with connect(gw.url) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nx-request-id: slow-1\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n"
            % declared
            + b'{"prompt": "'
        )
        status, error = status_and_error(read_to_end(sock))
    assert (status, error["code"]) == (408, "request_timeout")
    wait_until(lambda: access_lines(caplog), "the request's access-log line")
    [line] = access_lines(caplog)
    assert (line["request_id"], line["status"], line["route"]) == (
        "slow-1",
        408,
        "/v1/completions",
    )
    assert gw.state.slots.in_use == 0


def test_a_small_bodys_request_reaches_the_app_once_its_body_is_whole(gateway_with):
    # its task starts with the body there: one wake of the route, not one for the head
    # and another for the body (clients such as httpx write the two apart)
    gw = gateway_with(body_timeout=30)
    bodies = gw.state.admission.bodies
    body = json.dumps({"prompt": "a b", "max_tokens": 2}).encode()
    with connect(gw.url) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: "
            b"application/json\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body[:5])
        )
        time.sleep(0.3)  # a route started at the head would have metered those 5 bytes
        assert bodies.in_flight == 0
        sock.sendall(body[5:])
        answer = b""
        while not answer.endswith(b"}"):
            chunk = sock.recv(65536)
            assert chunk, answer
            answer += chunk
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), answer
    assert json.loads(payload)["choices"][0]["text"]


def test_half_request_lines_are_all_closed(gateway_with):
    gw = gateway_with(header_timeout=1)
    socks = [connect(gw.url) for _ in range(300)]
    try:
        for sock in socks:
            sock.sendall(b"GET /heal")
        results: list[bytes] = []

        def drain() -> None:
            for sock in socks:
                results.append(read_to_end(sock))

        reader = threading.Thread(target=drain)
        reader.start()
        reader.join(HANG_GUARD)
        assert len(results) == 300
        assert all(answer.startswith(b"HTTP/1.1 408") or not answer for answer in results)
    finally:
        for sock in socks:
            sock.close()


def test_connections_over_the_cap_are_refused(gateway_with):
    # when every open connection has a request in flight (here: a head, and a body
    # still to come), there is none to close for a newcomer
    gw = gateway_with(max_connections=2)
    held = [connect(gw.url) for _ in range(2)]
    for sock in held:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            b"content-type: application/json\r\ncontent-length: 100\r\n\r\n{"
        )
    time.sleep(0.5)  # both heads read (on a loaded machine, a read can wait this long)
    try:
        with connect(gw.url) as extra:
            status, error = status_and_error(read_to_end(extra))
        assert status == 503
        assert error["code"] == "server_busy"
    finally:
        for sock in held:
            sock.close()

    def served() -> bool:
        try:
            return httpx.get(f"{gw.url}/health", timeout=HANG_GUARD).is_success
        except httpx.TransportError:
            return False

    wait_until(served, "a connection to be free")


def test_the_deadlines_spare_a_request_the_app_is_serving(gateway_with):
    # the slow model takes ~1 s for 20 tokens, longer than both deadlines
    gw = gateway_with(header_timeout=0.3, body_timeout=0.3)
    body = {"model": "furnace-slow", "prompt": "w " * 40, "max_tokens": 20}
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        first = client.post("/v1/completions", json=body)
        assert first.is_success
        assert first.json()["usage"]["completion_tokens"] == 20
        # the same keep-alive connection serves the next request
        assert client.get("/health").is_success


def test_a_flood_of_silent_connections_does_not_keep_clients_out(gateway_with):
    # the cap full of connections that never send a byte: each newcomer closes the
    # oldest of them, and is served at once, not after `header_timeout`
    gw = gateway_with(max_connections=20, header_timeout=HANG_GUARD)
    silent = [connect(gw.url) for _ in range(30)]
    try:
        started = time.monotonic()
        for _ in range(5):
            with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
                assert client.get("/health").is_success
        assert time.monotonic() - started < HANG_GUARD / 2
        # the oldest were closed for the newer ones, without an answer
        for sock in silent[:10]:
            assert read_to_end(sock) == b""
    finally:
        for sock in silent:
            sock.close()


def test_the_head_timeout_shrinks_as_connections_near_the_cap(gateway_with):
    # past half of max_connections the head's deadline shrinks, to 1 s when full,
    # whatever header_timeout says
    gw = gateway_with(max_connections=10, header_timeout=HANG_GUARD)
    early = [connect(gw.url) for _ in range(5)]  # half: full deadline
    time.sleep(0.2)
    late = [connect(gw.url) for _ in range(5)]  # the last at the cap: 1 s
    try:
        started = time.monotonic()
        assert read_to_end(late[-1]) == b""  # closed, silent
        assert time.monotonic() - started < HANG_GUARD / 2
        early[0].setblocking(False)
        with pytest.raises(BlockingIOError):  # the first ones still wait, open
            early[0].recv(1)
    finally:
        for sock in early + late:
            sock.close()


# -- bodies before and while they are read (issue 25, Medium 4) ----------------------------


def open_body(url: str, size: int, key: str | None = None) -> socket.socket:
    """A connection that declares a `size`-byte completions body and sends 12 of it."""
    sock = connect(url)
    auth = f"authorization: Bearer {key}\r\n".encode() if key else b""
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n" + auth + b"content-type: "
        b"application/json\r\ncontent-length: " + str(size).encode() + b'\r\n\r\n{"prompt": '
    )
    return sock


def read_answer(sock: socket.socket) -> tuple[int, dict[str, str]]:
    """The status and error of one whole answer, its length said (the connection may
    stay open)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    fields = dict(line.split(b": ", 1) for line in head.lower().split(b"\r\n")[1:] if b": " in line)
    assert b"transfer-encoding" not in fields, head
    length = int(fields[b"content-length"])
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, data + body
        body += chunk
    return status_and_error(head + b"\r\n\r\n" + body[:length])


def padded(size: int) -> bytes:
    """A valid completions body of about `size` bytes (an unknown field is ignored)."""
    return json.dumps({"prompt": "a b", "max_tokens": 2, "padding": "x" * size}).encode()


def test_bodies_being_read_are_bounded_per_process(gateway_with):
    gw = gateway_with(max_body_bytes_in_flight=1_000_000, body_timeout=30)
    bodies = gw.state.admission.bodies
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        headers = {"content-type": "application/json"}
        with open_body(gw.url, 800_000):
            wait_until(lambda: bodies.in_flight == 800_000, "the first body's bytes counted")
            refused = client.post("/v1/completions", content=padded(300_000), headers=headers)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "server_busy"
            assert refused.headers["retry-after"]
            # one that fits beside it is read and served
            assert client.post("/v1/completions", content=padded(100_000), headers=headers)
        wait_until(lambda: bodies.in_flight == 0, "the dropped body's bytes given back")
        served = client.post("/v1/completions", content=padded(300_000), headers=headers)
        assert served.is_success, served.text


def test_bodies_being_read_are_bounded_per_team(gateway_with):
    search, chat = new_key("search"), new_key("chat")
    gw = gateway_with(
        **keyed({"search": {}, "chat": {}}, {search: "search", chat: "chat"}),
        max_team_body_bytes_in_flight=1_000_000,
        body_timeout=30,
    )
    bodies = gw.state.admission.bodies
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:

        def post(key: str) -> httpx.Response:
            headers = {"content-type": "application/json", **bearer(key)}
            return client.post("/v1/completions", content=padded(300_000), headers=headers)

        with open_body(gw.url, 800_000, search):
            wait_until(lambda: bodies.by_team.get("search") == 800_000, "the body counted")
            refused = post(search)
            assert refused.status_code == 429, refused.text
            error = refused.json()["error"]
            assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
            assert "bytes of request bodies" in error["message"]
            assert post(chat).is_success  # another team's bodies are its own
        wait_until(lambda: not bodies.by_team and bodies.in_flight == 0, "bytes given back")
        assert post(search).is_success


@pytest.mark.parametrize(
    "limits", [{"max_concurrent_requests": 1}, {"requests_per_minute": 1}], ids=str
)
def test_a_teams_limits_are_checked_before_its_body_is_read(gateway_with, limits):
    key = new_key("search")
    gw = gateway_with(**keyed({"search": limits}, {key: "search"}), body_timeout=30)
    body = {"model": "furnace-slow", "prompt": "a b c d e f g h", "stream": True}
    with (
        httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client,
        client.stream("POST", "/v1/completions", json=body, headers=bearer(key)) as stream,
    ):
        assert stream.status_code == 200
        # a body that never comes: refused on its head, not after `body_timeout`
        with open_body(gw.url, 4_000_000, key) as sock:
            started = time.monotonic()
            status, error = read_answer(sock)
        assert status == 429, error
        assert time.monotonic() - started < 10
        assert gw.state.admission.bodies.in_flight == 0
