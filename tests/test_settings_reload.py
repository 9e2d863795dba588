"""Hot reload of budgets, prices, aliases and fallbacks (gateway.teams.reload): the
config file changed under a running gateway takes effect on the keys file's tick,
usage already counted stays, and a bad file is refused, naming the field, while
what was in force stays."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

import gateway.teams
from gateway.config import load_config
from gateway.teams.reload import SettingsReload, check_served
from gateway.worker.demo import DEMO_MODEL
from tests.support.keys import bearer, new_key, sha256
from tests.support.servers import ServerLoop, Workers, start_gateway
from tests.support.waiting import HANG_GUARD, wait_until

CHAT = {"model": "chat", "messages": [{"role": "user", "content": "a b c"}], "max_tokens": 2}


def write(path: Path, raw: dict[str, Any]) -> None:
    """Replaces the file at once (a new inode, as a ConfigMap's volume swaps it)."""
    draft = path.with_suffix(".new")
    draft.write_text(yaml.safe_dump(raw))
    os.replace(draft, path)


@dataclass
class Reloading:
    """A gateway started from a config file (`raw`, at `path`) that it reads again every
    0.05 s, its settings' reloader, and a client with team alpha's key."""

    raw: dict[str, Any]
    path: Path
    settings: SettingsReload
    client: httpx.Client

    def write(self, raw: dict[str, Any] | None = None) -> None:
        """Replaces the file with `raw` (by default `self.raw`, as changed)."""
        write(self.path, self.raw if raw is None else raw)

    def ask(self) -> httpx.Response:
        return self.client.post("/v1/chat/completions", json=CHAT)


def base(workers: Workers, key: str) -> dict[str, Any]:
    """Two models, team alpha's key and a day's budget, alias `chat` on the demo model."""
    return {
        "host": "127.0.0.1",
        "port": 0,
        "log_level": "warning",
        "models": [
            {"name": DEMO_MODEL, "workers": [workers.demo.address]},
            {"name": "furnace-slow", "workers": [workers.slow.address]},
        ],
        "teams": {"alpha": {"budgets": [{"window": "day", "tokens": 100_000}]}},
        "keys": [{"sha256": sha256(key), "team": "alpha"}],
        "aliases": {"chat": [{"model": DEMO_MODEL}]},
    }


@pytest.fixture
def reloading(
    server_loop: ServerLoop, workers: Workers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Reloading]:
    """A gateway started from `base`'s file, read again every 0.05 s."""
    monkeypatch.setattr(gateway.teams, "KEYS_RELOAD_INTERVAL", 0.05)
    key, path = new_key("alpha"), tmp_path / "config.yaml"
    raw = base(workers, key)
    write(path, raw)
    gw = start_gateway(server_loop, load_config(path, env={}), str(path))
    try:
        settings = gw.state.teams.settings
        assert settings is not None
        with httpx.Client(base_url=gw.url, timeout=HANG_GUARD, headers=bearer(key)) as client:
            yield Reloading(raw, path, settings, client)
    finally:
        gw.stop()


def test_a_changed_budget_and_alias_apply_without_restart_and_a_bad_file_is_refused(
    reloading: Reloading, workers: Workers, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="furnace.reload")
    raw, settings, ask = reloading.raw, reloading.settings, reloading.ask
    first = ask()
    assert first.headers["x-furnace-model"] == DEMO_MODEL
    used = first.json()["usage"]["total_tokens"]

    # the split moves to the other model
    raw["aliases"] = {"chat": [{"model": "furnace-slow"}]}
    reloading.write()
    wait_until(lambda: settings.applied == 1, "the new file applied")
    second = ask()
    assert second.status_code == 200, second.text
    assert second.headers["x-furnace-model"] == "furnace-slow"
    used += second.json()["usage"]["total_tokens"]

    # a budget under what the window used: what was counted stays, so it is spent
    raw["teams"]["alpha"]["budgets"] = [{"window": "day", "tokens": used}]
    reloading.write()
    wait_until(lambda: settings.applied == 2, "the lower budget applied")
    spent = ask()
    assert spent.status_code == 429, spent.text
    assert spent.json()["error"]["code"] == "budget_exceeded"
    assert "Retry-After" in spent.headers

    # raised again: served, the remaining budget counted from what was used
    raw["teams"]["alpha"]["budgets"] = [{"window": "day", "tokens": used + 1000}]
    reloading.write()
    wait_until(lambda: settings.applied == 3, "the higher budget applied")
    again = ask()
    assert again.status_code == 200, again.text
    remaining = int(again.headers["x-furnace-budget-remaining-tokens-day"])
    assert 0 < remaining < 1000

    # bad files are refused, naming the field; the settings in force stay
    bad_files = [
        ({"aliases": {"chat": [{"model": "nope"}]}}, "aliases.chat[0].model"),
        ({"aliases": {"chat": [{"model": DEMO_MODEL, "weight": 0}]}}, "aliases.chat"),
        (
            {"teams": {"alpha": {"budgets": [{"window": "week", "tokens": 1}]}}},
            "teams.alpha.budgets[0].window",
        ),
        (
            {
                "models": [
                    *raw["models"],
                    {"name": "new-model", "workers": [workers.demo.address]},
                ],
                "aliases": {"chat": [{"model": "new-model"}]},
            },
            "aliases.chat[0].model: 'new-model' is not served by this gateway",
        ),
    ]
    for change, field in bad_files:
        caplog.clear()
        refused = settings.refused
        reloading.write({**raw, **change})
        wait_until(lambda r=refused: settings.refused == r + 1, "the bad file refused")
        assert field in caplog.text
        assert "not reloaded" in caplog.text
        still = ask()
        assert still.status_code == 200, still.text
        assert still.headers["x-furnace-model"] == "furnace-slow"
    assert settings.applied == 3


def test_a_change_that_needs_a_restart_is_logged_and_the_rest_applies(
    reloading: Reloading, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="furnace.reload")
    reloading.raw["max_body_bytes"] = 12345
    reloading.raw["aliases"] = {"chat": [{"model": "furnace-slow"}]}
    reloading.write()
    wait_until(lambda: reloading.settings.applied == 1, "the new file applied")
    assert "max_body_bytes changed; that takes effect at the next restart" in caplog.text
    assert reloading.ask().headers["x-furnace-model"] == "furnace-slow"


def test_fallbacks_and_prices_are_checked_against_the_models_served(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    raw = {
        "models": [
            {"name": "a", "workers": ["127.0.0.1:1"], "fallbacks": ["b"]},
            {"name": "b", "workers": ["127.0.0.1:1"], "prices": {"prompt": 1}},
        ]
    }
    write(path, raw)
    check_served(load_config(path, env={}), frozenset({"a", "b"}))
    with pytest.raises(Exception, match=r"models\[0\]\.fallbacks\[0\]: 'b' is not served"):
        check_served(load_config(path, env={}), frozenset({"a"}))
