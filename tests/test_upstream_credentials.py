"""`upstream: openai` models behind a private CA and a bearer key: the key comes
from the environment variable `api_key_env` names, goes on every call, and
never reaches a log or /metrics; `ca_file` verifies the upstream's TLS."""

import logging
import secrets

import httpx
import pytest

from gateway.config import ConfigError, ModelConfig, parse_config
from tests.support.certs import CertificateAuthority
from tests.support.openai_server import OpenAIServer
from tests.support.requests import user
from tests.support.waiting import HANG_GUARD

MODEL = "private-upstream"
KEY_ENV = "FURNACE_TEST_UPSTREAM_KEY"


@pytest.fixture
def upstream(server_loop, tmp_path):
    ca = CertificateAuthority(tmp_path, "upstream-ca")
    key = "sk-upstream-" + secrets.token_hex(16)
    server = OpenAIServer(MODEL, key, ca.issue("upstream", ips=("127.0.0.1",)))
    server_loop.call(server.start())
    yield server, ca
    server_loop.call(server.stop())


def chat(gw) -> httpx.Response:
    body = {"model": MODEL, "messages": user("hi")}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=HANG_GUARD)


def model(url: str, **credentials: str) -> ModelConfig:
    return ModelConfig(MODEL, workers=(url,), upstream="openai", **credentials)


def test_the_key_and_the_ca_reach_the_upstream_and_nothing_else(
    gateway_with, upstream, monkeypatch, caplog
):
    server, ca = upstream
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv(KEY_ENV, server.key)
    gw = gateway_with(models=(model(server.url, api_key_env=KEY_ENV, ca_file=ca.ca_file),))
    for _ in range(3):
        response = chat(gw)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == "hello"
    assert server.refused == 0
    with httpx.Client(timeout=HANG_GUARD) as client:
        models = client.get(gw.url + "/v1/models").text
        metrics = client.get(gw.url + "/metrics").text
        workers = client.get(gw.url + "/admin/workers").text
    for seen in (caplog.text, metrics, models, workers):
        assert server.key not in seen
        assert server.key[12:] not in seen


def test_without_the_key_or_the_ca_the_upstream_refuses(gateway_with, upstream, monkeypatch):
    server, ca = upstream
    no_key = gateway_with(models=(model(server.url, ca_file=ca.ca_file),))
    # its health checks are refused too, so the worker is out of the rotation
    refused = chat(no_key)
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "engine_unavailable"
    assert server.refused > 0

    monkeypatch.setenv(KEY_ENV, server.key)
    refused_before = server.refused
    untrusted = chat(gateway_with(models=(model(server.url, api_key_env=KEY_ENV),)))
    assert untrusted.status_code == 503, untrusted.text  # the system's roots do not know it
    assert untrusted.json()["error"]["code"] == "engine_unavailable"
    assert server.refused == refused_before  # no request got past the handshake


def test_the_config_checks_both_fields_at_start(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    row = {"name": MODEL, "upstream": "openai", "workers": ["https://127.0.0.1:1/v1"]}
    for extra, message in (
        ({"api_key_env": KEY_ENV}, f"the environment variable {KEY_ENV} is not set"),
        ({"ca_file": str(tmp_path / "missing.pem")}, "models[0].ca_file: cannot read"),
        ({"api_key_env": ""}, "models[0].api_key_env: expected a non-empty string"),
    ):
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            parse_config({"models": [{**row, **extra}]})
    grpc_row = {"name": MODEL, "workers": ["127.0.0.1:1"], "ca_file": str(tmp_path)}
    with pytest.raises(ConfigError, match="only for `upstream: openai`"):
        parse_config({"models": [grpc_row]})
    monkeypatch.setenv(KEY_ENV, "sk-set")
    config = parse_config({"models": [{**row, "api_key_env": KEY_ENV}]})
    assert config.models[0].api_key_env == KEY_ENV
    assert "sk-set" not in repr(config)
