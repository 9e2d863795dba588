"""The admin listener (`admin_port`), as Envoy's admin port: the metrics and the
fleet's workers name every model, worker and team, so a keyed gateway serves
them only there; the public listener answers them 404 in OpenAI's shape."""

from __future__ import annotations

import logging
import socket

import httpx
import pytest

from gateway.config import Config, ConfigError, ModelConfig, parse_config
from gateway.lifecycle import GatewayServer
from tests.support.keys import ask, keyed, new_key
from tests.support.waiting import HANG_GUARD

ADMIN = ("/metrics", "/metrics/json", "/admin/workers", "/admin/usage")
PROBES = ("/health", "/ready")


def get(base: str, path: str) -> httpx.Response:
    return httpx.get(base + path, timeout=HANG_GUARD)


def assert_not_found(response: httpx.Response) -> None:
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["code"] == "not_found"
    assert set(error) == {"message", "type", "param", "code"}


def a_keyed_gateway(gateway_with, **overrides):
    key = new_key("search")
    gw = gateway_with(
        **keyed({"search": {"models": ["furnace-demo"]}}, {key: "search"}), **overrides
    )
    return gw, key


def test_a_keyed_gateway_serves_the_admin_routes_on_the_admin_port_only(gateway_with):
    gw, key = a_keyed_gateway(gateway_with, admin_port=0)
    assert gw.admin_url is not None and gw.admin_url != gw.url
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        assert ask(client, key, model="furnace-demo", max_tokens=2).status_code == 200
    for path in ADMIN:
        assert_not_found(get(gw.url, path))
        assert get(gw.admin_url, path).status_code == 200, path
    for path in PROBES:  # kubelet may probe either listener
        assert get(gw.url, path).status_code == 200
        assert get(gw.admin_url, path).status_code == 200
    # every model, outside the team's allow-list too, and the workers' addresses
    workers = get(gw.admin_url, "/admin/workers").json()
    assert "furnace-slow" in str(workers)
    assert 'team="search"' in get(gw.admin_url, "/metrics").text
    # the API is not on the admin listener, key or none
    assert_not_found(httpx.post(gw.admin_url + "/v1/completions", json={}, timeout=HANG_GUARD))


def test_a_keyed_gateway_without_an_admin_port_serves_them_nowhere(gateway_with, caplog):
    with caplog.at_level(logging.WARNING, logger="furnace"):
        gw, _ = a_keyed_gateway(gateway_with)
    assert gw.admin_url is None
    for path in ADMIN:
        assert_not_found(get(gw.url, path))
    for path in PROBES:
        assert get(gw.url, path).status_code == 200
    # the warning names admin_port and every route it leaves unserved
    warnings = [r.getMessage() for r in caplog.records if "admin_port" in r.getMessage()]
    assert warnings and all(path in warnings[0] for path in ADMIN), warnings


def test_an_open_gateway_without_an_admin_port_serves_them_on_its_port(gateway_with):
    gw = gateway_with()
    assert gw.admin_url is None
    for path in (*ADMIN, *PROBES):
        assert get(gw.url, path).status_code == 200, path


def test_an_open_gateway_with_an_admin_port_moves_them_there_too(gateway_with):
    gw = gateway_with(admin_port=0)
    assert gw.admin_url is not None
    for path in ADMIN:
        assert_not_found(get(gw.url, path))
        assert get(gw.admin_url, path).status_code == 200, path


def test_the_admin_listener_is_unready_while_the_gateway_drains(gateway_with):
    gw = gateway_with(admin_port=0)
    assert get(gw.admin_url, "/ready").status_code == 200
    gw.state.ready = False
    try:
        assert get(gw.admin_url, "/ready").status_code == 503
    finally:
        gw.state.ready = True


def test_a_failed_admin_bind_closes_everything(server_loop, workers):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    admin_port = taken.getsockname()[1]
    model = ModelConfig("furnace-demo", workers=(workers.demo.address,))
    config = Config(
        host="127.0.0.1", port=0, admin_port=admin_port, log_level="critical", models=(model,)
    )

    async def start_on_a_taken_admin_port() -> tuple[list[bool], int, bool]:
        server = GatewayServer(config)
        with pytest.raises(SystemExit):
            await server.start()
        serving = [listener.is_serving() for listener in server.uvicorn.servers]
        return serving, server.gateway.fleet.background_tasks, server.gateway.ready

    try:
        serving, tasks_left, ready = server_loop.call(start_on_a_taken_admin_port())
    finally:
        taken.close()
    assert serving == [False], "the public listener was bound and must be closed again"
    assert tasks_left == 0, "the fleet's watchers were left running"
    assert not ready


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"port": 8000, "admin_port": 8000}, "admin_port: must differ from port"),
        ({"admin_port": 70000}, "admin_port: must be at most 65535"),
        ({"admin_port": "x"}, "admin_port"),
        ({"admin_host": ""}, "admin_host: expected a non-empty string"),
    ],
)
def test_the_admin_listener_settings_are_checked(raw, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(raw, env={})


def test_the_admin_port_comes_from_the_environment_as_a_number():
    config = parse_config({}, env={"FURNACE_ADMIN_PORT": "9090"})
    assert config.admin_port == 9090
    assert config.admin_host is None
