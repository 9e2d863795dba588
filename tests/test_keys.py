"""API keys: Bearer keys known by their SHA-256, one 401 for every wrong key, a
team's models, the keys file and its reload, and no key in logs or metrics."""

import hashlib
import json
import logging
from typing import Any

import httpx
import pytest

from gateway.config import ConfigError, parse_config
from gateway.worker.demo import DEMO_MODEL
from tests.support.keys import MODELS, ask, bearer, keyed, new_key, sha256
from tests.support.requests import user
from tests.support.scripted_worker import SCRIPTED_MODEL
from tests.support.waiting import HANG_GUARD, wait_until

CHAT = {"model": DEMO_MODEL, "messages": user("hello there")}


def test_every_wrong_key_gets_the_same_401(gateway_with):
    key = new_key("search")
    gw = gateway_with(**keyed({"search": {}}, {key: "search"}))
    wrong = {
        "no header": {},
        "another key": bearer(new_key("search")),
        "upper case": bearer(key.upper()),
        "swapped case": bearer(key.swapcase()),
        "a prefix": bearer(key[:-1]),
        "longer": bearer(key + "x"),
        "the digest itself": bearer(sha256(key)),
        "no token": {"Authorization": "Bearer"},
        "another scheme": {"Authorization": f"Basic {key}"},
        "no scheme": {"Authorization": key},
    }
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        bodies = set()
        for what, headers in wrong.items():
            for response in (
                client.post("/v1/chat/completions", json=CHAT, headers=headers),
                client.post("/v1/completions", json={"prompt": "a"}, headers=headers),
                client.get("/v1/models", headers=headers),
            ):
                assert response.status_code == 401, what
                bodies.add(response.content)
        assert len(bodies) == 1
        error = response.json()["error"]
        assert (error["type"], error["code"], error["param"]) == (
            "invalid_request_error",
            "invalid_api_key",
            None,
        )
        assert key not in response.text
        # every API route (vLLM's unversioned rerank and score too) wants the key
        for path in gw.state.app.hot:
            assert client.post(path, json={}).status_code == 401, path
        # the probes stay open; the metrics are on no public port (tests/test_admin_port.py)
        for path in ("/health", "/ready"):
            assert client.get(path).status_code == 200
        assert client.get("/metrics").status_code == 404
        # the right key, whatever the case of the scheme
        for scheme in ("Bearer", "bearer"):
            headers = {"Authorization": f"{scheme} {key}"}
            response = client.post("/v1/chat/completions", json=CHAT, headers=headers)
            assert response.status_code == 200
            assert response.json()["choices"][0]["message"]["content"] == "hello there"
        assert client.get("/v1/models", headers=bearer(key)).status_code == 200


def test_openai_sdk_with_a_key(gateway_with):
    import openai

    key = new_key("search")
    gw = gateway_with(**keyed({"search": {}}, {key: "search"}))
    with openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0) as sdk:
        reply = sdk.chat.completions.create(model=DEMO_MODEL, messages=user("one two"))
    assert reply.choices[0].message.content == "one two"
    with (
        openai.OpenAI(base_url=gw.url + "/v1", api_key=key.lower(), max_retries=0) as bad,
        pytest.raises(openai.AuthenticationError) as raised,
    ):
        bad.models.list()
    assert raised.value.code == "invalid_api_key"


def test_a_team_sees_and_uses_only_its_models(gateway_with):
    search, ads = new_key("search"), new_key("ads")
    teams = {"search": {"models": [DEMO_MODEL]}, "ads": {}}
    gw = gateway_with(**keyed(teams, {search: "search", ads: "ads"}))
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        listed = client.get("/v1/models", headers=bearer(search)).json()["data"]
        assert [m["id"] for m in listed] == [DEMO_MODEL]
        everything = client.get("/v1/models", headers=bearer(ads)).json()["data"]
        assert len(everything) == 4
        # a model the team may not use reads exactly as one that does not exist
        hidden = client.post(
            "/v1/completions",
            json={"model": SCRIPTED_MODEL, "prompt": "x"},
            headers=bearer(search),
        )
        missing = client.post(
            "/v1/completions", json={"model": "nope", "prompt": "x"}, headers=bearer(search)
        )
        assert hidden.status_code == missing.status_code == 404
        assert hidden.json()["error"]["code"] == "model_not_found"
        assert hidden.json() == {
            "error": {
                **missing.json()["error"],
                "message": missing.json()["error"]["message"].replace(
                    "`nope`", f"`{SCRIPTED_MODEL}`"
                ),
            }
        }
        # no model: the first LLM, which the team may use
        ok = client.post("/v1/completions", json={"prompt": "x y"}, headers=bearer(search))
        assert ok.status_code == 200
        other = client.post(
            "/v1/completions",
            json={"model": SCRIPTED_MODEL, "prompt": "x"},
            headers=bearer(ads),
        )
        assert other.status_code == 200
        # the 404 lists the language models the team may use, not its tensor models
        tensor = client.post(
            "/v1/completions", json={"model": "nope", "prompt": "x"}, headers=bearer(ads)
        )
        message = tensor.json()["error"]["message"]
        assert "furnace-demo" in message and "resnet-50" not in message


def test_keys_file_is_read_and_read_again_when_it_changes(gateway_with, tmp_path):
    first, second = new_key("search"), new_key("search")
    path = tmp_path / "keys.yaml"
    path.write_text(f"- sha256: {sha256(first)}\n  team: search\n")
    gw = gateway_with(**keyed({"search": {}}, {}, keys_file=str(path)))
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        assert client.get("/v1/models", headers=bearer(first)).status_code == 200
        assert client.get("/v1/models", headers=bearer(second)).status_code == 401
        # a Secret's new version: the second key replaces the first
        path.write_text(f"keys:\n  - sha256: {sha256(second)}\n    team: search\n")
        gw.state.teams.keys.reload_if_changed()
        assert client.get("/v1/models", headers=bearer(first)).status_code == 401
        assert client.get("/v1/models", headers=bearer(second)).status_code == 200
        # a broken file keeps the keys known
        path.write_text("- sha256: not-a-digest\n  team: search\n")
        gw.state.teams.keys.reload_if_changed()
        assert client.get("/v1/models", headers=bearer(second)).status_code == 200


def test_an_open_gateway_says_so_at_start(gateway_with, caplog):
    caplog.set_level(logging.WARNING, logger="furnace.teams")
    gw = gateway_with()
    assert "the gateway is open" in caplog.text
    assert httpx.get(gw.url + "/v1/models", timeout=HANG_GUARD).status_code == 200
    caplog.clear()
    gateway_with(**keyed({"search": {}}, {new_key("search"): "search"}))
    assert "the gateway is open" not in caplog.text


def test_keys_never_reach_logs_or_metrics(gateway_with, caplog):
    caplog.set_level(logging.DEBUG)
    key = new_key("search")
    gw = gateway_with(
        **keyed({"search": {"requests_per_minute": 100}}, {key: "search"}),
        log_prompts=True,
        admin_port=0,
    )
    sent = [key, key.upper(), key[:-1], new_key("search")]
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        for attempt in sent:
            headers = bearer(attempt)
            client.post("/v1/chat/completions", json=CHAT, headers=headers)
            client.post("/v1/completions", json={"prompt": "a", "stream": True}, headers=headers)
            client.post("/v1/completions", json={"model": "nope", "prompt": "a"}, headers=headers)
            client.get("/v1/models", headers=headers)
        metrics = client.get(f"{gw.admin_url}/metrics").text
        json_metrics = client.get(f"{gw.admin_url}/metrics/json").text
    assert "furnace_gateway_auth_failures_total 12.0" in metrics
    for attempt in sent:
        for secret in (attempt, attempt[8:], sha256(attempt)):
            assert secret not in caplog.text
            assert secret not in metrics
            assert secret not in json_metrics


def test_config_errors_name_the_field_and_never_echo_a_key():
    key = new_key("search")
    cases = {
        "keys[0].sha256": {"teams": {"a": {}}, "keys": [{"sha256": key, "team": "a"}]},
        "keys[0].team": {"teams": {"a": {}}, "keys": [{"sha256": sha256(key), "team": "b"}]},
        "keys[1].sha256: the same key": {
            "teams": {"a": {}},
            "keys": [{"sha256": sha256(key), "team": "a"}, {"sha256": sha256(key), "team": "a"}],
        },
        "teams.a.models[0]": {"teams": {"a": {"models": ["gpt-9"]}}},
        "teams.a.requests_per_minute": {"teams": {"a": {"requests_per_minute": 0}}},
        "teams.a.weight": {"teams": {"a": {"weight": -1}}},
        "teams.a.burst": {"teams": {"a": {"burst": 1}}},
        "teams.a b": {"teams": {"a b": {}}},
        "keys_file: cannot read": {"teams": {"a": {}}, "keys_file": "/nonexistent/keys.yaml"},
        "redis_url": {"redis_url": f"http://user:{key}@redis:6379"},
        "worker_tls.key_file": {"worker_tls": {"cert_file": __file__}},
        "worker_tls.ca_file: cannot read": {"worker_tls": {"ca_file": "/nonexistent/ca.pem"}},
        "models[0].max_tokens_limit": {
            "models": [{"name": "m", "workers": ["h:1"], "max_tokens_limit": 0}]
        },
        "max_messages": {"max_messages": 0},
    }
    for field, raw in cases.items():
        with pytest.raises(ConfigError) as raised:
            parse_config({"models": MODELS, **raw}, env={})
        assert str(raised.value).startswith(field), (field, str(raised.value))
        assert key not in str(raised.value)


def test_teams_keys_and_redis_from_the_environment():
    key = new_key("search")
    env = {
        "FURNACE_TEAMS": "{search: {requests_per_minute: 5, weight: 2}}",
        "FURNACE_KEYS": f"[{{sha256: {sha256(key)}, team: search}}]",
        "FURNACE_REDIS_URL": "redis://redis:6379/0",
        "FURNACE_MAX_MESSAGES": "10",
    }
    config = parse_config({"models": MODELS}, env=env)
    assert [(t.name, t.requests_per_minute, t.weight) for t in config.teams] == [("search", 5, 2.0)]
    assert config.keys[0].sha256 == hashlib.sha256(key.encode()).digest()
    assert config.redis_url == "redis://redis:6379/0"
    assert config.max_messages == 10


def test_the_access_log_says_whose_request_it_was_and_what_refused_it(gateway_with, caplog):
    """On a keyed gateway each access line names the route, the team and the key's id
    (the ledger's digest, never the key), and a rejection says which limit refused it."""
    caplog.set_level(logging.INFO, logger="furnace.access")
    key = new_key("search")
    gw = gateway_with(**keyed({"search": {"requests_per_minute": 1}}, {key: "search"}))
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        assert ask(client, key).status_code == 200
        assert ask(client, key).status_code == 429
    wait_until(lambda: len(_access_lines(caplog)) >= 2, "both access-log lines")
    served, refused = _access_lines(caplog)[-2:]
    for line in (served, refused):
        assert line["route"] == "/v1/completions" and line["team"] == "search"
        assert line["key_id"] == sha256(key)[: len(line["key_id"])] and key not in str(line)
    assert "reason" not in served and refused["reason"] == "team_requests"


def test_a_refused_key_has_its_access_line(gateway_with, caplog):
    """A 401 is logged as any refusal is: its route (any path reaches the check),
    status, outcome and reason, and the client's request id; no team, no key."""
    caplog.set_level(logging.INFO, logger="furnace.access")
    key = new_key("search")
    gw = gateway_with(**keyed({"search": {}}, {key: "search"}))
    wrong = new_key("search")
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        headers = {**bearer(wrong), "x-request-id": "probe-1"}
        assert client.post("/v1/chat/completions", json=CHAT, headers=headers).status_code == 401
        assert client.get("/v1/" + "x" * 300).status_code == 401
    wait_until(lambda: len(_access_lines(caplog)) >= 2, "both access-log lines")
    chat, other = _access_lines(caplog)[-2:]
    assert chat["route"] == "/v1/chat/completions" and chat["request_id"] == "probe-1"
    for line in (chat, other):
        assert (line["status"], line["outcome"], line["reason"]) == (401, "rejected", "invalid_key")
        assert "team" not in line and wrong not in str(line) and key not in str(line)
    assert other["route"] == "/v1/" + "x" * 196


def _access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "furnace.access"]
