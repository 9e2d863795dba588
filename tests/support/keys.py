"""API keys and teams for a test gateway: keys, their hashes, config overrides, 429 checks."""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

import httpx

from gateway.config import parse_config
from gateway.worker.demo import DEMO_MODEL
from tests.support.scripted_worker import SCRIPTED_MODEL

#: The test gateway's models, as YAML would list them (for the teams' allow-lists).
MODELS = [
    *({"name": name, "workers": ["127.0.0.1:1"]} for name in (DEMO_MODEL, "furnace-slow")),
    {"name": SCRIPTED_MODEL, "workers": ["127.0.0.1:1"]},
    {"name": "resnet-50", "kind": "tensor"},
]


def new_key(team: str) -> str:
    """A key with letters of both cases, so a case change makes another key."""
    return f"sk-{team}-Aa{secrets.token_urlsafe(24)}"


def sha256(key: str) -> str:
    """The key's SHA-256, as the keys list holds it."""
    return hashlib.sha256(key.encode()).hexdigest()


def keyed(teams: dict[str, Any], keys: dict[str, str], **raw: Any) -> dict[str, Any]:
    """`gateway_with` overrides for `teams` (as in YAML) and `keys` ({key: team}),
    checked by the config loader as a config file would be."""
    config = parse_config(
        {
            "models": MODELS,
            "teams": teams,
            "keys": [{"sha256": sha256(key), "team": team} for key, team in keys.items()],
            **raw,
        },
        env={},
    )
    fields = ("teams", "keys", *raw)
    return {name: getattr(config, name) for name in fields}


def bearer(key: str) -> dict[str, str]:
    """The Authorization header for `key`."""
    return {"Authorization": f"Bearer {key}"}


def ask(client: httpx.Client, key: str, prompt: str = "a b", **body: object) -> httpx.Response:
    """A completion request with `key`."""
    return client.post("/v1/completions", json={"prompt": prompt, **body}, headers=bearer(key))


def assert_rate_limited(response: httpx.Response, limit_name: str) -> None:
    """A 429 in OpenAI's shape, naming `limit_name`, with a Retry-After."""
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert limit_name in error["message"]
    assert int(response.headers["retry-after"]) >= 1
